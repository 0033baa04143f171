"""A run checkpoint's state as data: MessagePack of a closed set of types, never code.

Run folders are shared between people, and a checkpoint's manifest of checksums can be rewritten
by whoever rewrites a file, so reading a state file must not be able to run anything: no pickle.
A state file (``run.msgpack``, ``strategy.msgpack``) is one MessagePack map
``{"format": FORMAT, "what": "run" | "strategy", "state": ...}``. The state is msgpack's own
types (maps with str or int keys, arrays, str, int, float, bool, nil) plus one MessagePack
extension per further type a run's state holds, each decoded into exactly that type:

====  ==============  ===============================================================
code  type            extension payload
====  ==============  ===============================================================
1     tuple           msgpack array of the items
2     set             msgpack array of the items
3     torch.Tensor    ``[dtype, shape, raw bytes]`` (dtype from a fixed table; read on CPU)
4     numpy.ndarray   ``[dtype.str, shape, raw bytes]`` (no object dtype)
5     numpy scalar    ``[dtype.str, raw bytes]``
6     ``Delivery``    the exchange's own ``Envelope`` (msgpack), its record decoded by the
                      record codec: only a registered experience kind, checked against its type
7     a record        the same, for a record kept outside a delivery
8     plain data      ``[name, {field: value}]`` for the classes in ``PLAIN_DATA`` only
====  ==============  ===============================================================

Anything else in a state is refused when the checkpoint is written, naming where it sits: a
strategy's ``state_dict`` holds these types (see ``strategies.base``).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import msgspec
import numpy as np
import torch

from mutualrl.exchange.codec import Delivery, Envelope, RecordCodec, check_version
from mutualrl.exchange.errors import ExchangeError
from mutualrl.pacing import PacedRecord
from mutualrl.policies.samples import Sample
from mutualrl.tasks.base import Prompt

#: Version of the state file layout; a file of another format is not read.
FORMAT = 2

TUPLE, SET, TENSOR, ARRAY, SCALAR, DELIVERY, RECORD, DATA = range(1, 9)

#: The plain data classes a state may hold besides records (a paced or prefetching run's
#: samples and the records in flight between paced loops), by the name the file gives them.
PLAIN_DATA: MappingProxyType[str, type] = MappingProxyType(
    {"sample": Sample, "prompt": Prompt, "paced_record": PacedRecord}
)

_TORCH_DTYPES = MappingProxyType(
    {
        str(d).removeprefix("torch."): d
        for d in (
            torch.bool,
            torch.uint8,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
            torch.complex64,
            torch.complex128,
        )
    }
)


class StateEncodeError(TypeError):
    """A value a state file cannot hold (its path in the state and its type)."""


class StateDecodeError(ValueError):
    """A state file that is not one this version wrote: damaged, cut short or crafted."""


class UnknownKindInState(StateDecodeError):
    """A state file holds records of an experience kind this process has not registered."""


class _File(msgspec.Struct, kw_only=True):
    format: int
    what: str
    state: Any


def encode(state: Any, what: str) -> bytes:
    """``state`` as a state file's bytes; raises ``StateEncodeError`` naming what it cannot hold."""
    return msgspec.msgpack.encode(
        _File(format=FORMAT, what=what, state=_Encoder().data(state, what))
    )


def decode(data: bytes, what: str, where: str = "state file") -> Any:
    """The state ``encode(state, what)`` wrote; raises ``StateDecodeError`` for anything else."""
    try:
        head = msgspec.msgpack.decode(data, type=_Head)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StateDecodeError(f"{where}: not a state file ({exc})") from exc
    if head.format != FORMAT or head.what != what:
        raise StateDecodeError(
            f"{where}: holds {head.what!r} state of format {head.format}, "
            f"expected {what!r} state of format {FORMAT}"
        )
    hook = _Decoder(where).ext
    try:
        return msgspec.msgpack.decode(data, type=_File, ext_hook=hook).state
    except UnknownKindInState:
        raise
    except (
        msgspec.DecodeError,
        msgspec.ValidationError,
        ValueError,
        TypeError,
        ExchangeError,
    ) as exc:  # StateDecodeError is a ValueError
        raise StateDecodeError(f"{where}: {exc}") from exc


class _Head(msgspec.Struct):
    """A state file's format and subject, read before the state (its extensions left raw)."""

    format: int
    what: str


class _Encoder:
    def __init__(self) -> None:
        self.codec = RecordCodec()

    def data(self, obj: Any, path: str) -> Any:
        """``obj`` as msgpack's own types and ``msgspec.msgpack.Ext`` values."""
        if obj is None or type(obj) in (str, int, float, bool):
            return obj
        if isinstance(obj, dict):  # defaultdict, Counter: their loaders rebuild them
            return {self._key(k, path): self.data(v, f"{path}.{k}") for k, v in obj.items()}
        if type(obj) is list:
            return [self.data(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if type(obj) in (tuple, set, frozenset):
            items = sorted(obj, key=repr) if type(obj) is not tuple else obj
            code = TUPLE if type(obj) is tuple else SET
            return self._ext(code, [self.data(v, f"{path}[{i}]") for i, v in enumerate(items)])
        if isinstance(obj, torch.Tensor):
            return self._ext(TENSOR, _tensor_data(obj, path))
        if isinstance(obj, np.ndarray):
            return self._ext(ARRAY, _array_data(obj, path))
        if isinstance(obj, np.generic):
            return self._ext(SCALAR, [obj.dtype.str, obj.tobytes()])
        if type(obj) is Delivery:
            return self._ext(
                DELIVERY,
                self._envelope(
                    obj.record, obj.kind, obj.producer, obj.producer_version, obj.seq, path
                ),
            )
        name = next((n for n, cls in PLAIN_DATA.items() if type(obj) is cls), None)
        if name is not None:
            return self._ext(
                DATA,
                [name, {f: self.data(getattr(obj, f), f"{path}.{f}") for f in _field_names(obj)}],
            )
        if isinstance(obj, msgspec.Struct):
            try:
                kind = self.codec.kind_of(obj)
            except ExchangeError as exc:
                raise StateEncodeError(f"{path}: {exc}") from exc
            return self._ext(RECORD, self._envelope(obj, kind, "", 0, 0, path))
        raise StateEncodeError(
            f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be kept in a "
            "checkpoint; expected dicts (str or int keys), lists, tuples, sets, str, numbers, "
            "bool, None, tensors, numpy arrays and registered experience records"
        )

    def _envelope(
        self, record, kind: str, producer: str, version: int, seq: int, path: str
    ) -> Envelope:
        try:
            return self.codec.envelope(
                record, kind=kind, producer=producer, version=version, seq=seq
            )
        except ExchangeError as exc:
            raise StateEncodeError(f"{path}: {exc}") from exc

    @staticmethod
    def _key(key: Any, path: str) -> str | int:
        if type(key) in (str, int):
            return key
        raise StateEncodeError(
            f"{path}: key {key!r} ({type(key).__name__}); a checkpoint keeps "
            "maps with str or int keys"
        )

    @staticmethod
    def _ext(code: int, payload: Any) -> msgspec.msgpack.Ext:
        return msgspec.msgpack.Ext(code, msgspec.msgpack.encode(payload))


def _field_names(obj: Any) -> list[str]:
    if isinstance(obj, msgspec.Struct):
        return list(obj.__struct_fields__)
    return [f.name for f in dataclasses.fields(obj)]


def _tensor_data(t: torch.Tensor, path: str) -> list:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise StateEncodeError(
            f"{path}: a tensor of dtype {t.dtype}; a checkpoint keeps {', '.join(_TORCH_DTYPES)}"
        )
    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return [name, list(t.shape), raw]


def _array_data(a: np.ndarray, path: str) -> list:
    if a.dtype.hasobject:
        raise StateEncodeError(f"{path}: a numpy array of Python objects cannot be kept")
    return [a.dtype.str, list(a.shape), np.ascontiguousarray(a).tobytes()]


class _Decoder:
    """The extension hook: each code rebuilds its one type, from data checked on the way."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.codec = RecordCodec()
        self.by_code = {
            TUPLE: lambda v: tuple(v),
            SET: lambda v: set(v),
            TENSOR: _tensor,
            ARRAY: _array,
            SCALAR: _scalar,
            DELIVERY: self._delivery,
            RECORD: lambda v: self._delivery(v).record,
            DATA: _plain,
        }

    def ext(self, code: int, data: memoryview) -> Any:
        make = self.by_code.get(code)
        if make is None:
            raise StateDecodeError(f"{self.where}: unknown extension type {code}")
        if code in (DELIVERY, RECORD):
            return make(bytes(data))
        return make(msgspec.msgpack.decode(data, ext_hook=self.ext))

    def _delivery(self, raw: bytes) -> Delivery:
        env = msgspec.msgpack.decode(raw, type=Envelope)
        check_version(env.schema_version, self.where)
        record = self.codec.decode_record(env, where=self.where)
        if record is None:
            raise UnknownKindInState(
                f"{self.where} holds records of experience kind {env.kind!r}, "
                "which this process has not registered"
            )
        return Delivery(
            kind=env.kind,
            producer=env.producer,
            producer_version=env.producer_version,
            seq=env.seq,
            record=record,
        )


def _shape(value: Any) -> tuple[int, ...]:
    if not (isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)):
        raise StateDecodeError(f"expected a shape (a list of sizes), got {value!r}")
    return tuple(value)


def _tensor(v: Any) -> torch.Tensor:
    dtype_name, shape, raw = v
    dtype = _TORCH_DTYPES.get(dtype_name)
    if dtype is None or not isinstance(raw, bytes):
        raise StateDecodeError(f"expected a tensor [dtype, shape, bytes], got dtype {dtype_name!r}")
    shape = _shape(shape)
    numel = int(np.prod(shape, dtype=np.int64))
    if len(raw) != numel * dtype.itemsize:
        raise StateDecodeError(
            f"a tensor of shape {list(shape)} and dtype {dtype_name} holds "
            f"{len(raw)} bytes, expected {numel * dtype.itemsize}"
        )
    if not numel:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _numpy_dtype(name: Any) -> np.dtype:
    dtype = np.dtype(name) if isinstance(name, str) else None
    if dtype is None or dtype.hasobject:
        raise StateDecodeError(f"expected a numpy dtype without objects, got {name!r}")
    return dtype


def _array(v: Any) -> np.ndarray:
    name, shape, raw = v
    dtype, shape = _numpy_dtype(name), _shape(shape)
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _scalar(v: Any) -> np.generic:
    name, raw = v
    return np.frombuffer(raw, dtype=_numpy_dtype(name))[0]


def _plain(v: Any) -> Any:
    name, fields = v
    cls = PLAIN_DATA.get(name)
    if cls is None or not isinstance(fields, dict):
        raise StateDecodeError(f"unknown plain data {name!r} (known: {', '.join(PLAIN_DATA)})")
    return cls(**fields)
