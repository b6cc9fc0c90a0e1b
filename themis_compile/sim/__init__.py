"""The cluster simulator: Themis and the baselines of §5.1 on a simulated cluster, over a routing trace.

Modules, in import order (each imports only those before it, `cost_model` and `planner`):

* `traces` — routing traces (synthetic, recorded JSONL) and the statistics they are compared by;
* `setup` — `SimSetup`, the inputs derived once per (model, cluster, batch) with their derivations;
* `costs` — `LayerCost` and `Coster`, the AllReduce and migration times every policy is charged with;
* `policies` — each policy's own charges (`PolicyCharges` and its subclasses) around the planner's code;
* `engine` — `simulate`: the timeline of one representative device, results per policy;
* `report` — text tables, PNG plots and chrome traces of a `SimResult`;
* `paper` — ``simulate --paper``: the paper's §5 experiments next to its figures;
* `cli` — ``themis-compile simulate``; `inspect_model` — ``themis-compile inspect``.

See docs/simulator.md.
"""

from themis_compile.sim.engine import CATEGORIES, DEFAULT_POLICIES, PolicyResult, SimResult, simulate
from themis_compile.sim.paper import format_paper_report, paper_report, run_config
from themis_compile.sim.policies import CHARGES, PolicyCharges, charges_for
from themis_compile.sim.report import chrome_trace, format_tables, write_plots
from themis_compile.sim.setup import DEFAULT_BATCH, SimSetup, build_setup, read_profile, resolve_model_config
from themis_compile.sim.traces import RoutingTrace, read_jsonl, synthetic_trace, trace_statistics

__all__ = [
    "CATEGORIES", "DEFAULT_POLICIES", "DEFAULT_BATCH", "CHARGES", "PolicyCharges", "PolicyResult", "SimResult",
    "SimSetup", "RoutingTrace", "build_setup", "charges_for", "chrome_trace", "format_paper_report",
    "format_tables", "paper_report", "read_jsonl", "read_profile", "resolve_model_config", "run_config",
    "simulate", "synthetic_trace", "trace_statistics", "write_plots",
]
