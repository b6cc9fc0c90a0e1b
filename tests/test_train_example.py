"""examples/train.py: launched with torchrun on 2 gloo ranks for a few steps (a resume; a crash and the
restart that continues it, on a Hugging Face model directory and a directory of texts), and its
schedule, checkpoint discovery, model and data loading on their own."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(args: list[str], timeout_s: float, launcher: tuple[str, ...] = (), merge: bool = False,
              **env: str) -> subprocess.CompletedProcess:
    """``merge``: stderr into stdout, in the order written (the progress log goes to stdout, the rest
    to stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *launcher,
           str(SCRIPT), *args]
    # A session of its own, so that a timeout ends the launcher and both ranks, not the launcher alone.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun {' '.join(args)} did not finish in {timeout_s} s\n{out}\n{(err or '')[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err or "")


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    train = _load_script()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = train.cosine_schedule(opt, warmup=4, steps=20, min_ratio=0.1)
    lrs = []
    for _ in range(24):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[20:] == pytest.approx([0.1] * 4)


def test_latest_checkpoint_skips_unfinished_ones(tmp_path):
    train = _load_script()
    assert train.latest_checkpoint(str(tmp_path / "missing")) is None
    for step, finished in ((2, True), (4, True), (6, False)):
        d = tmp_path / f"step-{step:08d}"
        d.mkdir()
        if finished:
            (d / ".metadata").write_bytes(b"")
    assert train.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-00000004")


def test_train_script_resumes_where_it_stopped(tmp_path):
    """Four steps straight through (bf16 autocast, clipping; its log lines and checkpoints checked),
    against a ``--resume`` for the last two from the checkpoint that run wrote after step 2 (alone in a
    directory of its own, so that it is the latest): experts were re-sharded (every 2 steps) before the
    checkpoint, and the resumed steps log the same losses and gradient norms. (A run stopped after step
    2 writes the same checkpoint: the save is the same call, the warmup learning rate of the first two
    steps does not depend on ``--steps``; one launch fewer.)"""
    common = ["--model", "tiny", "--policy", "themis", "--steps", "4", "--batch", "2", "--seq-len", "32",
              "--log-every", "1", "--bf16", "--clip", "1.0", "--reshard-interval", "2", "--ckpt-every", "2"]
    pattern = r"step +(\d+)  loss ([\d.]+)  .*grad_norm ([\d.]+)"
    straight = _torchrun(common + ["--ckpt-dir", str(tmp_path / "a")], timeout_s=420)
    assert straight.returncode == 0, straight.stderr[-6000:]
    # What the script reports (rank 0 only, one line a step) and the checkpoints it writes.
    log = straight.stdout + straight.stderr
    assert "optimized by themis_compile (policy themis, rank 0 of 2): 2 MoE layer(s) sharded" in log
    lines = re.findall(r"step +(\d+)  loss ([\d.]+)  lr ([\d.e+-]+)  tok/s ([\d,]+)  imbalance ([\d.]+)  "
                       r"grad_norm ([\d.]+)", log)
    assert [int(step) for step, *_ in lines] == [1, 2, 3, 4], log[-4000:]
    for _, loss, lr, tok_s, imbalance, grad_norm in lines:
        assert 0 < float(loss) < 2 * math.log(256) and float(lr) > 0 and int(tok_s.replace(",", "")) > 0
        assert float(imbalance) >= 1.0 and float(grad_norm) > 0
    ckpt = tmp_path / "a"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000004"]
    assert all((ckpt / name / ".metadata").exists() for name in ("step-00000002", "step-00000004"))
    shutil.copytree(ckpt / "step-00000002", tmp_path / "b" / "step-00000002")
    resumed = _torchrun(common + ["--ckpt-dir", str(tmp_path / "b"), "--resume"], timeout_s=420)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    want = re.findall(pattern, straight.stdout + straight.stderr)
    got = re.findall(pattern, resumed.stdout + resumed.stderr)
    assert [s for s, *_ in want] == ["1", "2", "3", "4"], straight.stdout[-3000:]
    assert got == want[2:], (got, want)


# ------------------------------------------------------------------------------------------- your model and data
WORDS = "the expert router token layer shard rank node gather scatter reduce plan step loss model data".split()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny HF Mixtral saved with ``save_pretrained`` beside a tokenizer trained here (BPE, 100 tokens),
    a config-only copy of it, and three text files."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("hf")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(400)) for _ in range(3)]
    (root / "texts").mkdir()
    for i, text in enumerate(texts):
        (root / "texts" / f"part{i}.txt").write_text(text)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "</s>"]))
    torch.manual_seed(1)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                                             num_experts_per_tok=2, max_position_embeddings=64))
    model.save_pretrained(root / "model")
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>").save_pretrained(root / "model")
    (root / "config-only").mkdir()
    shutil.copy(root / "model" / "config.json", root / "config-only" / "config.json")
    return root


def _step_lines(log: str) -> list[tuple[int, str]]:
    return [(int(s), loss) for s, loss in re.findall(r"step +(\d+)  loss ([\d.]+)", log)]


def test_train_script_restarts_after_a_crash_with_resume_auto(tmp_path, hf_dir):
    """One ``torchrun --max-restarts 1 ... --resume auto`` command on an HF model directory (weights and
    tokenizer) and a directory of texts: the first attempt starts from scratch (no checkpoint yet), rank
    1 exits after 3 steps, torchrun restarts both ranks and they continue from the checkpoint of step 2
    to the end, repeating step 3 with the same loss. The first step's loss is the loaded model's own
    loss on that global batch of the tokenized texts, computed here in one process; the HF export
    (``--export-dir``) loads with ``from_pretrained`` equal to the final checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = _load_script()
    ckpt, export = tmp_path / "ckpt", tmp_path / "export"
    args = ["--model", str(hf_dir / "model"), "--data", str(hf_dir / "texts"), "--steps", "4", "--batch", "2",
            "--seq-len", "32", "--log-every", "1", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--resume", "auto",
            "--collective-timeout", "60", "--export-dir", str(export)]
    run = _torchrun(args, timeout_s=240, launcher=("--max-restarts", "1", "--monitor-interval", "0.5"),
                    merge=True, TRAIN_EXAMPLE_CRASH_AT_STEP="3")
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    first, _, second = log.partition("rank 1: exiting after 3 steps (TRAIN_EXAMPLE_CRASH_AT_STEP)")
    assert second, "rank 1 never crashed:\n" + log[-4000:]
    assert "starting from step 0" in first and f"resuming from {ckpt / 'step-00000002'} (step 2)" in second
    assert log.count("weights loaded") == 2 and "(tokenizer: " in log and "(tokenizer: bytes)" not in log
    before, after = _step_lines(first + second.split("model: ", 1)[0]), _step_lines(second.split("model: ", 1)[1])
    assert [s for s, _ in before][:2] == [1, 2] and [s for s, _ in after] == [3, 4], log[-4000:]
    if len(before) == 3:                      # rank 0 logged step 3 before torchrun stopped it: the same loss
        assert before[2] == after[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000004"]

    # The first loss: the saved weights, on the texts as the model's tokenizer reads them.
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir / "model"))
    docs, _ = train.load_documents(str(hf_dir / "texts"))
    tokens = train.tokenize(docs, tokenizer)
    assert f"{tokens.size:,} tokens from 3 text file(s)" in log
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir / "model"), dtype=torch.float32)
    batch = torch.from_numpy(train.sample_batch(tokens, 0, 4, 32, seed=0))
    with torch.no_grad():
        want = model(input_ids=batch, labels=batch).loss.item()
    assert abs(float(before[0][1]) - want) <= 1e-4, (before[0], want)

    # The export of the last step, loadable by transformers.
    dcp_to_torch_save(ckpt / "step-00000004", tmp_path / "final.pt")
    final = torch.load(tmp_path / "final.pt", weights_only=False)["model"]
    loaded = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).state_dict()
    assert loaded.keys() == final.keys()
    for key, value in final.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    exported_tokenizer = AutoTokenizer.from_pretrained(str(export))
    assert exported_tokenizer("the expert")["input_ids"] == tokenizer("the expert")["input_ids"]


def test_model_from_a_directory_or_a_config(hf_dir):
    """A directory with weights loads them; a directory with only config.json, or a config.json, is
    initialised at random from that config; the tokenizer comes from the directory when it has one."""
    from safetensors.torch import load_file

    train = _load_script()
    saved = load_file(hf_dir / "model" / "model.safetensors")
    key = "model.embed_tokens.weight"         # a key that the checkpoint and the model name alike
    loaded, tokenizer, what = train.load_model(str(hf_dir / "model"), 32)
    assert "weights loaded" in what and tokenizer is not None and len(tokenizer) <= 128
    assert torch.equal(loaded.state_dict()[key], saved[key])
    for spec in (hf_dir / "config-only", hf_dir / "config-only" / "config.json", hf_dir / "model" / "config.json"):
        torch.manual_seed(0)
        model, tok, what = train.load_model(str(spec), 32)
        assert type(model).__name__ == "MixtralForCausalLM" and "random init" in what, (spec, what)
        assert model.config.num_local_experts == 4 and model.state_dict()[key].shape == saved[key].shape
        assert not torch.equal(model.state_dict()[key], saved[key])
        assert (tok is None) == (spec.parent.name == "config-only" or spec.name == "config-only")
    with pytest.raises(SystemExit):
        train.parse_args(["--model", str(hf_dir / "missing")])
    assert train.parse_args(["--ckpt-dir", "x", "--resume"]).resume == "latest"
    assert train.parse_args(["--ckpt-dir", "x", "--resume", "auto"]).resume == "auto"


class _FakeDataset:
    def __init__(self, rows: dict[str, list]) -> None:
        self.rows, self.column_names = rows, list(rows)

    def __getitem__(self, column: str) -> list:
        return self.rows[column]


def test_data_from_files_directories_and_saved_datasets(tmp_path, hf_dir, monkeypatch):
    import types

    from transformers import AutoTokenizer

    train = _load_script()
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir / "model"))
    # A directory: every file in path order, each followed by the end-of-sequence token.
    tokens, what = train.load_tokens(str(hf_dir / "texts"), tokenizer, 128, 32)
    texts = [(hf_dir / "texts" / f"part{i}.txt").read_text() for i in range(3)]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    want = [t for doc in ids for t in (*doc, tokenizer.eos_token_id)]
    assert tokens.tolist() == want and "3 text file(s)" in what
    # One file; without a tokenizer its UTF-8 bytes, for a model of >= 256 embeddings only.
    one = hf_dir / "texts" / "part1.txt"
    one_ids = tokenizer(texts[1], add_special_tokens=False)["input_ids"]
    assert train.load_tokens(str(one), tokenizer, 128, 32)[0].tolist() == [*one_ids, tokenizer.eos_token_id]
    byte_tokens, what = train.load_tokens(str(one), None, 256, 32)
    assert bytes(byte_tokens.astype("uint8").tolist()) == texts[1].encode() + b"\n" and "(tokenizer: bytes)" in what
    with pytest.raises(ValueError, match="no tokenizer and a vocabulary of 128"):
        train.load_tokens(str(one), None, 128, 32)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 50"):
        train.load_tokens(str(one), tokenizer, 50, 32)
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "blob.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not a UTF-8 text file"):
        train.load_tokens(str(tmp_path / "binary"), tokenizer, 128, 32)

    # A dataset saved with save_to_disk: its "text" column (the train split of a dataset dict).
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text('{"splits": ["train"]}')
    monkeypatch.setitem(sys.modules, "datasets", None)              # not installed: a clear error
    with pytest.raises(ImportError, match="pip install datasets"):
        train.load_tokens(str(saved), tokenizer, 128, 32)
    fake = types.SimpleNamespace(load_from_disk=lambda path: {"train": _FakeDataset({"text": texts, "id": [0, 1, 2]})})
    monkeypatch.setitem(sys.modules, "datasets", fake)
    tokens, what = train.load_tokens(str(saved), tokenizer, 128, 32)
    assert tokens.tolist() == want and "saved dataset" in what
    fake.load_from_disk = lambda path: _FakeDataset({"content": texts})
    with pytest.raises(ValueError, match=r"no 'text' column \(columns: \['content'\]\)"):
        train.load_tokens(str(saved), tokenizer, 128, 32)


