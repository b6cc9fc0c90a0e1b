"""The MoE families of the installed ``transformers``, each as a tiny random model (no download).

A family is MoE when its ``modeling_*.py`` defines experts: it assigns ``self.experts`` or defines a
class named like ``*Experts*`` / ``*MoE*``. The list is derived from the installed package, never written down, so a
new transformers release is measured as it is.

``tiny_model(family)`` starts from the family's own config class defaults and shrinks only sizes
(hidden sizes, layers, heads, experts, vocabulary), turns dropout and router noise off and makes expert
capacity unbounded, so that routing depends on each token alone (the one-process reference and the
sharded run then see the same routing on any split of the batch).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil
import re

import torch

# `Experts`, plural: a class named like `*ActionExpert*` (pi05's action model, a dense transformer) is not MoE.
_MOE_SOURCE = re.compile(r"self\.experts\s*=|^class \w*(Experts|MoE|Moe)\w*\(", re.MULTILINE)

# Size fields and their tiny values; a field is shrunk only when the config has it.
_SIZES = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "dim": 32, "embed_dim": 32, "model_dim": 32,
    "intermediate_size": 32, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "expert_ffn_hidden_size": 16,
    "shared_experts_intermediate_size": 32, "linear_head_dim": 8, "linear_num_heads": 4,
    "ffn_dim": 32, "d_ff": 32, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "ffn_hidden_size": 32,
    "expert_intermediate_size": 16, "moe_ffn_hidden_size": 16, "ffn_config_hidden": 32,
    "num_hidden_layers": 2, "n_layers": 2, "num_layers": 2, "n_layer": 2, "num_decoder_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2,
    "num_attention_heads": 4, "n_heads": 4, "n_head": 4, "num_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_key_value_heads": 2, "n_kv_heads": 2, "head_dim": 8, "d_kv": 8,
    "vocab_size": 128, "max_position_embeddings": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "top_k_experts": 2, "moe_topk": 2, "moe_k": 2, "top_k": 2, "moe_top_k": 2,
    "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_start_index": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "index_head_dim": 8, "index_n_heads": 2, "index_topk": 4,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_expand": 2,
    "mamba_chunk_size": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "sliding_window": 16, "kv_channels": 8, "ffn_hidden": 32,
    "moe_num_shared_experts": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "zero_expert_num": 2, "share_expert_dim": 32, "num_expert_group": 2, "encoder_sparse_step": 2,
    "decoder_sparse_step": 2, "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1, "num_experts_per_token": 2, "num_dense_layers": 1, "index_kpool": 2, "global_head_dim": 8, "hidden_size_per_layer_input": 8,
}

# Sizes some configs leave None by default (the model then fails to build without them).
_UNSET_SIZES = {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "head_dim",
                "num_experts", "top_k_experts"}

# Families whose validators need more than sizes (the field the validator names).
_FAMILY = {
    "zaya": {"num_experts_per_tok": 1},
    "doge": {"is_moe": True},
    "qwen4_exp": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
                  "indexer_compress_ratio": 2},
    "gemma4": {"enable_moe_block": True},
    "flint": {"mlp_only_layers": [0]},
    "dbrx": {"attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "glm5_next": {"qk_rope_head_dim": 0, "q_lora_rank": 16},
    "lfm2_moe": {"layer_types": ["full_attention", "conv"]},
    "deepseek_ocr2": {"num_experts_per_tok": 2, "mlp_layer_types": ["dense", "sparse"]},
    "mistral4": {"head_dim": 16, "qk_head_dim": 16},
    # NVFP4 rounding of keys and values needs head_dim % 16 == 0; layers 0 and 1 are dense by default.
    "kolibri1_1": {"head_dim": 16, "index_num_heads": 2, "mlp_only_layers": [0], "mlp_only_intermediate_size": 32},
    "glm4v_moe": {"hidden_size": 64, "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                                         "rope_type": "default", "mrope_section": [2, 1, 1]}},
    "hy_v4_vl": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 1, 1]}},
    "ernie4_5_vl_moe": {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default",
                                            "mrope_section": [1, 1, 2]}},
    "hunyuan_v1_moe": {"head_dim": 8},
    "dots1": {"moe_intermediate_size": 16},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "step3p7": {"sliding_window": 16},
    "switch_transformers": {"decoder_start_token_id": 0},
    "muse_spark": {"moe_hidden_size": 32},    # the experts' own width (default 4096)
    # The full-attention layers' head_dim is `global_head_dim` (512 by default, not a config field once
    # built); the canvas is the second half of a test sequence; the (unused) vision tower made small.
    "diffusion_gemma": {"canvas_length": 4, "text_config": {"global_head_dim": 8},
                        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 32,
                                          "num_hidden_layers": 1, "num_attention_heads": 4,
                                          "num_key_value_heads": 4, "head_dim": 8, "position_embedding_size": 64}},
}

# Families whose text model with a loss is none of the class names `_model_class` looks for.
_CLASS = {
    "diffusion_gemma": "DiffusionGemmaForBlockDiffusion",   # kind "block-diffusion", see family_loss
}


@functools.lru_cache(maxsize=None)
def moe_families() -> dict[str, str]:
    """family -> modeling module name, for every family whose modeling code defines experts."""
    import transformers.models as models

    out = {}
    for info in pkgutil.iter_modules(models.__path__):
        folder = os.path.join(models.__path__[0], info.name)
        for fname in sorted(os.listdir(folder)) if info.ispkg else ():
            if fname.startswith("modeling_") and fname.endswith(".py"):
                with open(os.path.join(folder, fname), encoding="utf-8") as f:
                    text = f.read()
                    if ("experts" in text or "Expert" in text or "MoE" in text or "Moe" in text) and \
                            _MOE_SOURCE.search(text):
                        out[info.name] = f"transformers.models.{info.name}.{fname[:-3]}"
                        break
    return out


def _model_class(module):
    """The family's text model with a loss head when it has one: ``*ForCausalLM``, else an
    encoder-decoder ``*ForConditionalGeneration`` taking ``input_ids``, else ``*TextModel`` / ``*Model``."""
    from transformers import PreTrainedModel

    classes = {n: c for n, c in vars(module).items() if inspect.isclass(c) and issubclass(c, PreTrainedModel)
               and c.__module__ == module.__name__ and "PreTrained" not in n}
    for pattern in (r"ForCausalLM$", r"^[A-Za-z0-9_]+ForConditionalGeneration$", r"TextModel$", r"Model$"):
        for name, cls in classes.items():
            if re.search(pattern, name) and not re.search(r"Vision|Audio|Talker|Code2Wav|Encoder", name):
                if pattern.startswith("^") and not getattr(cls.config_class, "is_encoder_decoder", False) and \
                        "encoder_layers" not in inspect.signature(cls.config_class.__init__).parameters:
                    continue
                return cls
    return None


def _shrink_dict(d: dict) -> dict:
    """Tiny values for the size fields of a config dict (sub-config dicts and per-layer lists too)."""
    over = {k: v for k, v in _SIZES.items() if k in d and (isinstance(d[k], int) and not isinstance(d[k], bool)
                                                         or d[k] is None and k in _UNSET_SIZES)}
    n_layers = next((d[k] for k in ("num_hidden_layers", "n_layers", "num_layers") if isinstance(d.get(k), int)), None)
    for k, v in d.items():
        if isinstance(v, dict) and set(v) & set(_SIZES) and not k.endswith(("vision_config", "audio_config")):
            sub = {**v, **_shrink_dict(v)}
            sub.pop("per_layer_config", None)   # re-derived from the shrunk layer types
            over[k] = sub
        elif isinstance(v, list) and n_layers and len(v) == n_layers and n_layers > 2:
            # Two layers of different kinds where the default has several ("dense" then "sparse").
            over[k] = [v[0], next((u for u in v if u != v[0]), v[1])]
        elif isinstance(v, dict) and v and all(isinstance(i, int) for i in v):   # per-layer overrides
            over[k] = {i: o for i, o in v.items() if i < 2}
        elif k.endswith("_token_id") and isinstance(v, int) and v >= _SIZES["vocab_size"]:
            over[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(k, 3)
    if d.get("num_key_value_heads") is not None and d.get("num_key_value_heads") == d.get("num_attention_heads"):
        over["num_key_value_heads"] = over.get("num_attention_heads", d["num_attention_heads"])
    if d.get("q_lora_rank") is None:
        over.pop("q_lora_rank", None)
    return over


def _shrunk(config_class, extra: dict | None = None):
    defaults = config_class()
    d = defaults.to_dict()
    over = _shrink_dict(d)
    for k, v in d.items():
        if isinstance(v, float) and ("dropout" in k or "jitter" in k or k.endswith("_pdrop") or k.endswith("layerdrop")):
            over[k] = 0.0
        if "capacity" in k and isinstance(v, (int, float)) and not isinstance(v, bool):
            over[k] = 1024 if isinstance(v, int) else 1024.0   # no token dropped on any split of the batch
    if "num_key_value_heads" in over and d.get("num_key_value_heads") is None:
        over.pop("num_key_value_heads")
    for k, v in (extra or {}).items():    # a sub-config's extras are merged into its shrunk sizes
        over[k] = {**over[k], **v} if isinstance(v, dict) and isinstance(over.get(k), dict) else v
    return config_class(**over)


def tiny_model(family: str, seed: int = 0):
    """The tiny model of ``family``, its kind ("causal-lm", "seq2seq", "block-diffusion" or "base": how
    :func:`family_loss` calls it) in ``model._themis_test_kind``."""
    module = importlib.import_module(moe_families()[family])
    cls = getattr(module, _CLASS[family]) if family in _CLASS else _model_class(module)
    if cls is None:
        raise LookupError(f"{family}: no text model class in {module.__name__}")
    config = _shrunk(cls.config_class, _FAMILY.get(family))
    torch.manual_seed(seed)
    model = cls(config)
    name = cls.__name__
    kind = "causal-lm" if name.endswith("ForCausalLM") else "seq2seq" if name.endswith(
        "ForConditionalGeneration") else "block-diffusion" if name.endswith("ForBlockDiffusion") else "base"
    model._themis_test_kind = kind
    return model


def family_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """A per-token mean loss: the LM loss for language models, the denoising loss of a block-diffusion
    model (:func:`_block_diffusion_loss`), the mean square of the last hidden state for a bare text model."""
    kind = model._themis_test_kind
    if kind in ("causal-lm", "seq2seq"):
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss
    if kind == "block-diffusion":
        return _block_diffusion_loss(model, tokens)
    kwargs = {"decoder_input_ids": tokens} if "decoder_input_ids" in inspect.signature(model.forward).parameters \
        else {}
    return model(input_ids=tokens, use_cache=False, **kwargs).last_hidden_state.float().pow(2).mean()


def noised_block(clean_BC: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each row of ``clean_BC`` with a fraction t ~ U(0, 1) of its tokens replaced by uniform random ones
    (the uniform-noise forward process DiffusionGemma's canvas starts from), drawn from a generator seeded
    by the row itself: the noise belongs to the example, so any split of the batch sees the same canvas."""
    out = clean_BC.clone()
    for b, row in enumerate(clean_BC):
        g = torch.Generator().manual_seed(int((row * torch.arange(1, row.numel() + 1)).sum()))
        t = torch.rand((), generator=g)
        noise = torch.randint(0, vocab_size, row.shape, generator=g)
        out[b] = torch.where(torch.rand(row.shape, generator=g) < t, noise, row)
    return out


def _block_diffusion_loss(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    """The first half of each sequence is the prompt (the encoder's prefix), the second half the block:
    its noised copy is the decoder's canvas, and the loss is the cross-entropy of the logits against the
    clean block, a mean over every block token.

    The canvas is passed, not left to the model: without ``decoder_input_ids`` DiffusionGemmaModel draws
    it with ``torch.randint`` from the global generator inside its forward, so each rank would draw its
    own numbers for its own rows, not those one process draws for the same rows of the whole batch."""
    half = tokens_BS.shape[1] // 2
    prompt_BP, clean_BC = tokens_BS[:, :half], tokens_BS[:, half:]
    canvas_BC = noised_block(clean_BC, model.config.text_config.vocab_size)
    logits_BCV = model(input_ids=prompt_BP, decoder_input_ids=canvas_BC, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits_BCV.flatten(0, 1).float(), clean_BC.flatten())


def expected_moe_modules(model) -> list[str]:
    """Names of the modules holding a child called ``experts`` (the transformers convention): what a
    detector that understands the family must report."""
    return [name for name, m in model.named_modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)
            and "experts" in dict(m.named_children())]
