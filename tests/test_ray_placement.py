"""Where tensor-parallel ranks go on GPUs with the ray backend (executor/ray_ranks.py):
the placement group holds a GPU for every rank, the driver's too, so no two ranks share
a device. Checked on a Ray instance of its own with fake GPUs (Ray hands out GPU ids
without any GPU), in a child process: the shared test instance has none."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.executor.ray_ranks import bundle_index, local_device_index, placement_bundles

ROOT = Path(__file__).resolve().parents[1]


def test_bundles_hold_the_drivers_gpu_on_its_node():
    bundles = placement_bundles(4, gpu=True, driver_node_ip="10.0.0.5")
    assert len(bundles) == 4 and all(b["GPU"] == 1 for b in bundles)
    assert "node:10.0.0.5" in bundles[0] and all("node:10.0.0.5" not in b for b in bundles[1:])
    assert [bundle_index(r, True) for r in range(4)] == [0, 1, 2, 3]
    # On CPUs the driver takes nothing from Ray: one bundle per rank actor.
    assert placement_bundles(3, gpu=False, driver_node_ip="10.0.0.5") == [{"CPU": 1}] * 2
    assert [bundle_index(r, False) for r in (1, 2)] == [0, 1]


def test_drivers_gpu_id_to_a_local_device_index():
    assert local_device_index("3", None) == 3
    assert local_device_index("3", "2,3") == 1
    with pytest.raises(ValueError, match="cannot see"):
        local_device_index("0", "2,3")


CHECK = """
import json, ray
ray.init(address="local", num_cpus=3, num_gpus=3, include_dashboard=False, log_to_driver=False)
from pagedserve.config import EngineConfig
from pagedserve.executor.ray_ranks import RayRanks
ranks = RayRanks(EngineConfig(device="cuda", tensor_parallel_size=3, distributed_executor_backend="ray"))
ranks.reserve()
actors = [ranks.spawn(rank) for rank in (1, 2)]
ids = ray.get([a.gpu_ids.remote() for a in actors])
print(json.dumps(dict(driver=ranks.driver_gpu_id, driver_device=str(ranks.driver_device()), ranks=ids)))
ranks.stop(graceful=False)
ray.shutdown()
"""


def test_ranks_and_driver_get_distinct_gpus_with_fake_gpu_resources():
    pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    ids = [r["driver"]] + [i for rank in r["ranks"] for i in rank]
    assert len(ids) == 3 and len(set(ids)) == 3, r        # one GPU each, none shared
    assert r["driver_device"] == f"cuda:{r['driver']}"
