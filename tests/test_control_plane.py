"""The tensor-parallel control plane against someone who can reach its ports (issue 34): the
driver's commands are msgpack plain data, authenticated with a per-launch HMAC secret, so a
forged, altered, replayed or pickled message is refused; real step batches survive the trip
exactly (the outputs are the same as without it); the rendezvous binds the given address only."""
from __future__ import annotations

import pickle
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pagedserve.batch import StepBatch
from pagedserve.distributed.wire import ControlChannel, RefusedMessage, new_secret
from pagedserve.worker.model_runner import ModelRunner
from tests.test_batch import _run, make_llm, run_workload


def test_real_step_batches_round_trip_exactly_and_give_the_same_outputs(tiny_llama, monkeypatch):
    secret = new_secret()
    driver, rank = ControlChannel(secret), ControlChannel(secret)
    direct, trips = [], []
    expected = _run(make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=512, seed=1), False, direct,
                    monkeypatch)
    execute = ModelRunner.execute

    def execute_over_the_wire(self, batch: StepBatch):
        kind, got = rank.open(driver.seal(("execute", batch)))
        assert kind == "execute"
        trips.append((batch, got))
        return execute(self, got)
    monkeypatch.setattr(ModelRunner, "execute", execute_over_the_wire)
    assert run_workload(make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=512, seed=1)) == expected
    assert any(b.grammar_bitmask is not None for b, _ in trips)
    for sent, got in trips:
        if sent.grammar_bitmask is not None:
            assert np.array_equal(sent.grammar_bitmask, got.grammar_bitmask)
            sent.grammar_bitmask = got.grammar_bitmask = None
        assert sent == got


def test_forged_altered_replayed_and_pickled_messages_are_refused():
    secret = new_secret()
    driver, rank = ControlChannel(secret), ControlChannel(secret)
    ok = driver.seal(("stop", None))
    with pytest.raises(RefusedMessage):
        ControlChannel(new_secret()).open(ok)                        # another launch's key
    tampered = bytearray(ok)
    tampered[-1] ^= 1
    with pytest.raises(RefusedMessage):
        ControlChannel(secret).open(bytes(tampered))                 # altered payload
    with pytest.raises(RefusedMessage):
        ControlChannel(secret).open(pickle.dumps(("execute", StepBatch())))   # the old format, unsigned
    with pytest.raises(RefusedMessage):
        ControlChannel(secret).open(b"\x00" * 32 + b"\x93")        # zero MAC
    assert rank.open(ok) == ("stop", None)
    with pytest.raises(RefusedMessage):
        rank.open(ok)                                                # replayed: the counter moved on


def test_only_plain_data_is_sent_or_rebuilt():
    secret = new_secret()

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    with pytest.raises(TypeError):
        ControlChannel(secret).seal(("execute", Evil()))
    # An authentic message naming a class outside the step records is refused too.
    import msgpack
    from pagedserve.distributed import wire
    payload = msgpack.packb(msgpack.ExtType(wire._DATACLASS, msgpack.packb(["Popen", [["sh"]]])))
    forged = ControlChannel(secret)._mac(0, payload) + payload
    with pytest.raises(RefusedMessage, match="Popen"):
        ControlChannel(secret).open(forged)


def test_the_rendezvous_binds_the_given_address_only():
    """A one-rank group at 127.0.0.1: its store is reachable there, not at 127.0.0.2 (another
    address of this machine), as it would be if it listened on 0.0.0.0."""
    from pagedserve.distributed.group import free_port
    port = free_port()
    code = textwrap.dedent(f"""
        import socket, torch
        from pagedserve.distributed.group import TensorParallelGroup
        g = TensorParallelGroup(0, 1, "tcp://127.0.0.1:{port}#{new_secret()}", torch.device("cpu"), 10)
        def reach(host):
            try:
                socket.create_connection((host, {port}), timeout=2).close()
                return True
            except OSError:
                return False
        print("REACH", reach("127.0.0.1"), reach("127.0.0.2"))
        g.destroy()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REACH True False" in out.stdout, out.stdout + out.stderr[-3000:]


def test_a_group_without_the_secret_is_refused():
    from pagedserve.distributed.group import TensorParallelGroup
    import torch
    with pytest.raises(ValueError, match="secret"):
        TensorParallelGroup(0, 1, "tcp://127.0.0.1:1", torch.device("cpu"), 10)


def test_ray_ranks_rendezvous_at_the_nodes_address_not_all_interfaces(monkeypatch):
    import ray.util
    from pagedserve.config import EngineConfig
    from pagedserve.executor import ray_ranks
    bound = []
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(ray_ranks, "free_port", lambda host="127.0.0.1": bound.append(host) or 5555)
    ranks = ray_ranks.RayRanks.__new__(ray_ranks.RayRanks)
    ranks.config = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert ranks.init_method().startswith("tcp://127.0.0.1:5555")
    assert bound == ["127.0.0.1"]


def test_a_rank_allocates_nothing_for_a_length_it_cannot_trust(monkeypatch):
    """The length comes before the MAC can be checked: a forged 2^62 is refused before any
    buffer of it is made (issue 51: the rank allocated first)."""
    import torch

    from pagedserve.distributed import group as g
    rank = object.__new__(g.TensorParallelGroup)
    rank.rank, rank.world_size, rank.channel = 1, 2, ControlChannel(new_secret())
    made = []

    def broadcast(t, src=0, async_op=False):
        if t.dtype == torch.int64:
            t.fill_(2**62)
        made.append(t.numel())
    monkeypatch.setattr(g.dist, "broadcast", broadcast)
    real_empty = torch.empty
    monkeypatch.setattr(g.torch, "empty", lambda *a, **k: made.append(a) or real_empty(0, dtype=torch.uint8))
    with pytest.raises(RefusedMessage, match="limit"):
        rank.broadcast()
    assert made == [1], made      # the length's tensor only
