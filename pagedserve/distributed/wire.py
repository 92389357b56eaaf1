"""The driver's commands to the tensor-parallel ranks, as authenticated plain data.

Anyone who can reach a rank's connections must not be able to make it do anything: a command
is msgpack (which builds only numbers, strings, bytes, lists and maps: it cannot run code, as
unpickling can) and is refused unless its HMAC-SHA256, keyed by a secret made per launch and
handed to the ranks when they start, matches. The MAC covers a message counter, so a recorded
command cannot be replayed or reordered. Dataclasses travel as (name, field values) and are
rebuilt only from the names in `_CLASSES`; numpy arrays as (dtype, shape, bytes), only of the
dtypes in `_DTYPES`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets

import msgpack
import numpy as np

from pagedserve.batch import LoRALoad, PromptLogprobsRange, SampleRow, SamplingSettings, ScheduledTokens, StepBatch

MAC_BYTES = 32
_CLASSES = {cls.__name__: cls for cls in (StepBatch, ScheduledTokens, SampleRow, SamplingSettings,
                                          PromptLogprobsRange, LoRALoad)}
_DTYPES = {"int32", "int64", "float32", "uint8", "bool"}
_TUPLE, _DATACLASS, _ARRAY = 1, 2, 3     # msgpack extension type codes


class RefusedMessage(RuntimeError):
    """A control message that is not the driver's (bad MAC, replayed, or not plain data)."""


def new_secret() -> str:
    return secrets.token_hex(32)


def _pack(obj) -> bytes:
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def _default(obj):
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in _CLASSES:
        values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        return msgpack.ExtType(_DATACLASS, _pack([type(obj).__name__, values]))
    if isinstance(obj, np.ndarray) and obj.dtype.name in _DTYPES:
        return msgpack.ExtType(_ARRAY, _pack([obj.dtype.name, list(obj.shape), obj.tobytes()]))
    raise TypeError(f"the control channel carries plain data only, not {type(obj).__name__}")


def _unpack(data: bytes):
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True)


def _ext_hook(code: int, data: bytes):
    if code == _TUPLE:
        return tuple(_unpack(data))
    if code == _DATACLASS:
        name, values = _unpack(data)
        cls = _CLASSES.get(name)
        if cls is None or not isinstance(values, list) or len(values) != len(dataclasses.fields(cls)):
            raise RefusedMessage(f"not a known step record: {name!r}")
        return cls(*values)
    if code == _ARRAY:
        dtype, shape, raw = _unpack(data)
        if dtype not in _DTYPES:
            raise RefusedMessage(f"array dtype {dtype!r} refused")
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    raise RefusedMessage(f"unknown msgpack extension {code}")


class ControlChannel:
    """One side of the driver -> ranks channel: `seal` on the driver, `open` on each rank, one
    call per message, in order (the counters advance together)."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("the control channel needs the launch's secret")
        self._key = bytes.fromhex(secret)
        self._sent = 0
        self._received = 0

    def _mac(self, counter: int, payload: bytes) -> bytes:
        return hmac.new(self._key, counter.to_bytes(8, "little") + payload, hashlib.sha256).digest()

    def seal(self, command) -> bytes:
        payload = _pack(command)
        message = self._mac(self._sent, payload) + payload
        self._sent += 1
        return message

    def open(self, message: bytes):
        """The command, or RefusedMessage if it is not the driver's next one."""
        mac, payload = message[:MAC_BYTES], message[MAC_BYTES:]
        if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, self._mac(self._received, payload)):
            raise RefusedMessage("a control message failed authentication (not from this launch's driver, "
                                 "altered, or replayed): refused")
        self._received += 1
        try:
            return _unpack(payload)
        except RefusedMessage:
            raise
        except Exception as e:   # noqa: BLE001 - authentic but malformed: still refused
            raise RefusedMessage(f"a control message is not plain step data: {e}") from None
