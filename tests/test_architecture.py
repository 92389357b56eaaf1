"""The one-way arrows of docs/architecture.md that imports can show."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pagedserve"


def imports_of(folder: str) -> dict[str, set[str]]:
    out = {}
    for path in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        out[path.name] = names
    return out


@pytest.mark.parametrize("forbidden", ["pagedserve.kernels", "pagedserve.attention.cpu_backend"])
def test_the_models_import_nothing_cpu_specific(forbidden):
    for name, modules in imports_of("models").items():
        assert not [m for m in modules if m.startswith(forbidden)], f"models/{name} imports {forbidden}"


def test_the_kv_cache_knows_no_tensors_and_no_requests():
    for name, modules in imports_of("kv").items():
        assert not {"torch", "pagedserve.request", "pagedserve.scheduler"} & modules, f"kv/{name}"


def test_the_router_and_the_simulator_need_no_ray_and_no_tensors():
    """Routing is pure Python (unit-tested without a cluster); only the replica actor's client
    knows Ray, and only the replica knows the engine."""
    cluster = imports_of("cluster")
    for name in ("routing.py", "sim.py"):
        assert not {m for m in cluster[name] if m.split(".")[0] in ("ray", "torch")}, f"cluster/{name}"
        assert "pagedserve.engine.async_llm" not in cluster[name], f"cluster/{name}"
    assert "pagedserve.cluster.client" not in cluster["replica.py"], "the replica must not know the router"
