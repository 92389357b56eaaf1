"""The tensor-parallel process group: every collective the ranks run, over torch.distributed.

Two groups over the same ranks:
- the control group (gloo, the default group), which carries the driver's step commands
  (`StepBatch`es as msgpack plain data, each authenticated with the launch's HMAC secret:
  distributed/wire.py) to the other ranks. A rank waits on it between steps for as long
  as the engine is idle, so its timeout is long; the driver's sends wait `distributed_timeout`;
- the compute group (gloo on CPU, NCCL on CUDA), which carries the model's all-reduces and
  the LM head's gather, with `distributed_timeout` seconds per collective: a rank that hangs
  fails the step instead of hanging the engine. A rank that dies fails it at once (its
  connections close).

Rank 0 is the driver (in the engine's process); it alone samples, from the gathered logits.

The init method is `tcp://HOST:PORT#SECRET`: the driver's rendezvous store listens on HOST
only (a socket bound here and handed to torch's TCPStore; never 0.0.0.0 unless HOST is), and
SECRET (made per launch, handed to the ranks with their start arguments) keys every command.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from pagedserve.distributed.wire import ControlChannel, RefusedMessage

# The largest control message a rank accepts (a step's batch is about 200 bytes a sequence, a
# grammar bitmask a bit per vocabulary entry and row): the length arrives before the MAC can be
# checked, so a rank allocates only what this allows.
MAX_MESSAGE_BYTES = 256 * 1024**2


def checked_message_size(size: int) -> int:
    """The length a control message announces, refused (RefusedMessage) before anything is
    allocated for it when it is not a plausible one."""
    if not 0 < size <= MAX_MESSAGE_BYTES:
        raise RefusedMessage(f"a control message of {size} bytes (the limit is {MAX_MESSAGE_BYTES}): not the "
                             f"driver's")
    return size

# How long a rank waits for the driver's next command (the engine may idle for days).
CONTROL_TIMEOUT = timedelta(days=30)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    def __init__(self, rank: int, world_size: int, init_method: str, device: torch.device,
                 timeout_s: float) -> None:
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one tensor-parallel "
                               "engine per process (shut the other one down first)")
        self.rank, self.world_size = rank, world_size
        address, _, secret = init_method.partition("#")
        if not secret:
            raise ValueError("the tensor-parallel init method needs the launch's secret (tcp://HOST:PORT#SECRET)")
        self.channel = ControlChannel(secret)
        url = urlsplit(address)
        host, port = url.hostname, url.port
        self._listener = None
        if rank == 0:
            # Bound here, to HOST alone: torch's own store server would listen on every interface.
            self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host
                                                  else socket.AF_INET, backlog=max(16, world_size * 4))
            store = dist.TCPStore(host, port, world_size, True, CONTROL_TIMEOUT,
                                  master_listen_fd=self._listener.fileno())
        else:
            store = dist.TCPStore(host, port, world_size, False, CONTROL_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=CONTROL_TIMEOUT)
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout = timedelta(seconds=timeout_s)
        self.compute = dist.new_group(backend=backend, timeout=self.timeout)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's partial x, in place."""
        dist.all_reduce(x, group=self.compute)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """On the driver, every rank's x [rows, part] side by side: [rows, world_size * part]
        (each rank's part has the same width); None on the other ranks."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=0, group=self.compute)
        return torch.cat(parts, dim=1) if self.is_driver else None

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (all ranks must size the KV cache alike)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast(self, command: object = None) -> object:
        """The driver's command, on every rank (the driver passes it, the others receive it),
        sealed by the control channel (msgpack, HMAC: a message that is not the driver's next
        one raises RefusedMessage on the rank). The other ranks wait for it as long as the
        engine idles; the driver waits `timeout_s` at most for them to take it (gloo's send
        waits for the receiver)."""
        if self.is_driver:
            data = bytearray(self.channel.seal(command))
            checked_message_size(len(data))
            for t in (torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(data, dtype=torch.uint8)):
                dist.broadcast(t, src=0, async_op=True).wait(self.timeout)
            return command
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0)
        data = torch.empty(checked_message_size(int(size.item())), dtype=torch.uint8)
        dist.broadcast(data, src=0)
        return self.channel.open(data.numpy().tobytes())

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
