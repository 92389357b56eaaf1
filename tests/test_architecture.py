"""Every arrow docs/architecture.md draws, checked on the imports (ast: any import anywhere in a
module, at its top or inside a function). An arrow A -> B allows A to import B; the rules below
are the imports that would point one back the other way, or skip a room."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pagedserve"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            # `from a.b import c` is a.b.c (a module or a name of a.b), never the bare package a.b:
            # an allowed a.b.quant must not let `from a.b import cpu` through by its prefix.
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def imports_of(room: str) -> dict[str, set[str]]:
    """Module path (relative to pagedserve/) -> what it imports, for a folder or one file."""
    target = ROOT / room
    paths = [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))
    return {str(p.relative_to(ROOT)): _imports(p) for p in paths}


def hits(modules: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden))


# room -> the imports it must not have: each line is an arrow of the diagram or a sentence of
# the text ("Arrows point one way" and the rooms' one-line rules).
UPPER = ("pagedserve.server", "pagedserve.cli")
RULES: dict[str, tuple[str, ...]] = {
    # The engine knows neither who serves it nor the replicas above it, nor the simulator beside it.
    "engine": UPPER + ("pagedserve.cluster", "pagedserve.sim"),
    # Data parallelism sits between the server and the engine: it never reaches back up
    # (its stat logger is passed in: engine/protocol.py).
    "cluster": UPPER,
    # The scheduler: below the engine, above kv/ and structured/; it sends plain data to the
    # worker (batch.py) and knows no tensors and no text (the engine's output side makes it).
    "scheduler.py": UPPER + ("pagedserve.engine", "pagedserve.cluster", "pagedserve.executor", "pagedserve.worker",
                             "pagedserve.models", "pagedserve.attention", "pagedserve.kernels", "pagedserve.sim",
                             "torch", "tokenizers", "transformers"),
    # The scheduler's read-only view of its queues: the same room.
    "queue_view.py": UPPER + ("pagedserve.engine", "pagedserve.cluster", "pagedserve.executor", "pagedserve.worker",
                              "pagedserve.models", "pagedserve.attention", "pagedserve.kernels", "torch"),
    "request.py": UPPER + ("pagedserve.engine", "pagedserve.scheduler", "pagedserve.cluster", "pagedserve.worker",
                           "pagedserve.executor", "torch"),
    "invariants.py": UPPER + ("pagedserve.engine", "pagedserve.cluster", "pagedserve.worker", "torch"),
    # kv/ knows block ids and counts, never tensors, requests or the scheduler: pure Python.
    "kv": UPPER + ("torch", "pagedserve.request", "pagedserve.scheduler", "pagedserve.engine", "pagedserve.cluster",
                   "pagedserve.worker", "pagedserve.executor", "pagedserve.models", "pagedserve.structured"),
    # The step's data: plain data, no tensors, nothing of the scheduler's records.
    "batch.py": UPPER + ("torch", "pagedserve.request", "pagedserve.scheduler", "pagedserve.engine"),
    # structured/: engine-side; the scheduler drives its matchers; the worker never sees it.
    "structured": UPPER + ("pagedserve.scheduler", "pagedserve.engine", "pagedserve.request", "pagedserve.worker",
                           "pagedserve.executor", "pagedserve.cluster"),
    # The executor carries StepBatches to the workers: plain data, no scheduler or engine.
    "executor": UPPER + ("pagedserve.scheduler", "pagedserve.engine", "pagedserve.request", "pagedserve.cluster",
                         "pagedserve.structured"),
    # The worker imports nothing of the scheduler, the engine or request.py (nor structured/:
    # the bitmask reaches it as data).
    "worker": UPPER + ("pagedserve.scheduler", "pagedserve.engine", "pagedserve.request", "pagedserve.structured",
                       "pagedserve.cluster", "pagedserve.executor", "pagedserve.invariants"),
    # The sampler runs in the worker (driver only): same rule.
    "sampling/sampler.py": UPPER + ("pagedserve.scheduler", "pagedserve.engine", "pagedserve.request",
                                    "pagedserve.structured", "pagedserve.worker", "pagedserve.executor"),
    # The model knows no device: ops and attention are chosen by the worker; nothing CPU-specific.
    "models": UPPER + ("pagedserve.kernels", "pagedserve.attention.cpu_backend", "pagedserve.attention.torch_backend",
                       "pagedserve.attention.triton_backend", "pagedserve.worker", "pagedserve.executor",
                       "pagedserve.scheduler", "pagedserve.engine", "pagedserve.request"),
    "attention": UPPER + ("pagedserve.models", "pagedserve.worker", "pagedserve.executor", "pagedserve.scheduler",
                          "pagedserve.engine"),
    "kernels": UPPER + ("pagedserve.worker", "pagedserve.executor", "pagedserve.scheduler", "pagedserve.engine"),
    # The quantized weights' data (GGML blocks, QuantizedWeight, the torch reference): below both
    # models/ (which holds them) and kernels/ (which computes with them); it imports neither.
    "quant_format.py": UPPER + ("pagedserve.models", "pagedserve.kernels", "pagedserve.attention",
                                "pagedserve.worker", "pagedserve.executor", "pagedserve.scheduler", "pagedserve.engine"),
    # MXFP4's block format (gpt-oss's experts): data and its exact decoding, the same place.
    "mxfp4.py": UPPER + ("pagedserve.models", "pagedserve.kernels", "pagedserve.attention",
                         "pagedserve.worker", "pagedserve.executor", "pagedserve.scheduler", "pagedserve.engine"),
    "distributed": UPPER + ("pagedserve.worker", "pagedserve.executor", "pagedserve.scheduler", "pagedserve.engine",
                            "pagedserve.models"),
    # spec_decode/: proposers run on the scheduler's side on token ids, verification in the worker
    # on plain data; neither reaches the engine, the scheduler or the requests.
    "spec_decode": UPPER + ("pagedserve.engine", "pagedserve.scheduler", "pagedserve.request",
                            "pagedserve.structured", "pagedserve.executor", "pagedserve.cluster"),
    # lora/: the scheduler's slots and the worker's weights share the adapter's reading and its
    # request; neither reaches the engine, the scheduler, the requests or the server.
    "lora": UPPER + ("pagedserve.engine", "pagedserve.scheduler", "pagedserve.request", "pagedserve.executor",
                     "pagedserve.worker", "pagedserve.cluster", "pagedserve.structured", "pagedserve.models"),
    # lora/request.py (LoRARequest, re-exported at the top) and slots.py (the scheduler's view)
    # know no tensors and no kernels.
    "lora/request.py": ("torch", "pagedserve"),
    "lora/slots.py": ("torch", "pagedserve.kernels", "pagedserve.lora.weights", "pagedserve.lora.adapter"),
    # utils.py is pure Python (kv/ imports it): nothing of pagedserve, no torch.
    "utils.py": ("torch", "pagedserve"),
    # The settings know every room's choices, but build nothing: no engine, worker or model code.
    "config.py": UPPER + ("pagedserve.engine", "pagedserve.scheduler", "pagedserve.worker", "pagedserve.executor",
                          "pagedserve.cluster", "pagedserve.kernels", "pagedserve.models.loader",
                          "pagedserve.models.llama", "pagedserve.attention", "pagedserve.lora.weights"),
    # Request parameters: validated data, no tensors, nothing of the engine.
    "pooling_params.py": UPPER + ("torch", "pagedserve.engine", "pagedserve.scheduler", "pagedserve.request",
                                  "pagedserve.worker", "pagedserve.models"),
    "sampling_params.py": UPPER + ("torch", "pagedserve.engine", "pagedserve.scheduler", "pagedserve.request",
                                   "pagedserve.worker", "pagedserve.models"),
    # Beam search's candidate selection: pure Python over scores, called by the scheduler.
    "sampling/beam_search.py": ("torch", "pagedserve"),
    # sim/ stands beside the engine: it drives the real Scheduler, with no model and no engine.
    "sim": UPPER + ("pagedserve.engine", "pagedserve.worker", "pagedserve.executor", "pagedserve.models.llama",
                    "pagedserve.attention", "pagedserve.kernels", "pagedserve.cluster"),
}
# The exceptions to a room's rule, each an arrow of the diagram.
# sim/local.py is the simulator's calibration: it times the engine's own kernels (the model's
# linear layers, attention backend and sampler), so it alone in sim/ reaches below the engine.
ALLOWED: dict[str, tuple[str, ...]] = {
    "sim/local.py": ("pagedserve.attention", "pagedserve.kernels", "pagedserve.worker", "pagedserve.models"),
}


def allowed(room: str, name: str, module: str) -> bool:
    """The module is an allowed one (for the room or this file of it) or a name in it: an exact
    match, never a package that merely contains an allowed module."""
    return any(module == a or module.startswith(a + ".") for a in ALLOWED.get(room, ()) + ALLOWED.get(name, ()))


@pytest.mark.parametrize("room", sorted(RULES))
def test_arrows_point_one_way(room):
    bad = {name: found for name, modules in imports_of(room).items()
           if (found := [m for m in hits(modules, RULES[room]) if not allowed(room, name, m)])}
    assert not bad, f"{room} imports what it must not: {bad}"


def test_the_router_and_the_simulator_need_no_ray_and_no_tensors():
    """Routing is pure Python (unit-tested without a cluster); only the replica actor's client
    knows Ray, and only the replica knows the engine."""
    cluster = imports_of("cluster")
    for name in ("cluster/routing.py", "cluster/sim.py"):
        assert not {m for m in cluster[name] if m.split(".")[0] in ("ray", "torch")}, name
        assert not hits(cluster[name], ("pagedserve.engine",)), name
    assert not hits(cluster["cluster/replica.py"], ("pagedserve.cluster.client",)), "the replica knows no router"


def test_the_server_codes_against_the_engine_client_protocol():
    """Only app.py builds the engine client (AsyncLLM or DataParallelLLM); every other module of
    the server sees it as an EngineClient (engine/protocol.py)."""
    for name, modules in imports_of("server").items():
        if name == "server/app.py":
            continue
        assert not hits(modules, ("pagedserve.engine.async_llm.AsyncLLM", "pagedserve.cluster")), name
        assert not hits(modules, ("pagedserve.engine.llm_engine",)), name


def test_the_front_end_and_the_engine_each_make_their_tokenizer_in_one_place():
    """load_tokenizer is called by the engine (its own) and engine/tokenizer.py (the front end's)."""
    callers = sorted(name for name, modules in {**imports_of("server"), **imports_of("cluster"),
                                                **imports_of("engine")}.items()
                     if "pagedserve.models.loader.load_tokenizer" in modules)
    assert callers == ["engine/llm_engine.py", "engine/tokenizer.py"], callers


def test_only_request_create_makes_requests():
    """Request.create is the one constructor: nothing else builds a Request or a Sequence by hand
    (request.py's fork_seq makes the forked sequences)."""
    calls = set()
    for path in ROOT.rglob("*.py"):
        calls |= {f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("Request", "Sequence")}
    allowed = {f"request.py:{node.lineno}" for fn in ast.walk(ast.parse((ROOT / "request.py").read_text()))
               if isinstance(fn, ast.FunctionDef) and fn.name in ("create", "fork_seq")
               for node in ast.walk(fn) if isinstance(node, ast.Call)}
    assert not calls - allowed, sorted(calls - allowed)


def test_an_allowed_module_lets_through_neither_its_package_nor_its_siblings(tmp_path, monkeypatch):
    """Where `models` may import kernels.quant: not `import pagedserve.kernels` (then `.cpu` by
    attribute) nor `from pagedserve.kernels import cpu`, which a prefix match let through."""
    monkeypatch.setitem(ALLOWED, "models", ("pagedserve.kernels.quant",))
    src = tmp_path / "m.py"
    src.write_text("import pagedserve.kernels\nfrom pagedserve.kernels import cpu, quant\n"
                   "from pagedserve.kernels.quant import QuantizedWeight\n")
    found = _imports(src)
    bad = [m for m in hits(found, RULES["models"]) if not allowed("models", "models/m.py", m)]
    assert bad == ["pagedserve.kernels", "pagedserve.kernels.cpu"], bad
