"""Turning what people type into `JobRequest`s: `--input NAME=VALUE` arguments and JSON requests
(a request file, stdin, or one line of a bulk file).

A value is JSON (`[[1, 2, 3, 4]]`), `@file.npy` (a numpy array), `@file.json` / `@file` (JSON read
from the file) or `@-` (JSON from stdin); in JSON requests it may also be spelled out as
{"datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}. The datatype comes from, in order:
the value's own "datatype", `--datatype`, the model's signature (the pinned version's for a request
that names one; as the gateway's ListModels says, or from `--config FILE` when given), or else the JSON itself (any
float: FP32, integers: INT64, booleans: BOOL, strings: BYTES). When the signature has one more
dimension than the value, the value is one row: a batch dimension of 1 is added. A value that
datatype cannot hold as written (1.5 for INT64, 300 or -1 for UINT8, 1e300 for FP32) is a usage
error naming the input and what the model takes, never cast (numpy's cast made them 1, 44, 255 and
inf); so is a whole float for an integer input (2.0 for INT64: "has 2.0, a float: INT64 takes
integers (write 2, not 2.0)"), as the SDK and a JSONL batch line refuse it. Floats are rounded to the
type's precision.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from asyncinfer.client import (
    AsyncClient,
    Callback,
    CallbackEvent,
    JobRequest,
    NotFoundError,
    Priority,
    UnimplementedError,
)
from asyncinfer.commands.output import UsageError
from asyncinfer.errors import AsyncInferError
from asyncinfer.tensors import (
    NUMPY_DTYPES,
    RAGGED_REASON,
    ModelSignature,
    TensorSpec,
    as_one_row,
    booleans_misplaced,
    cast_change,
    typed_as,
)

REQUEST_KEYS = frozenset(
    {
        "model",
        "model_name",
        "model_version",
        "inputs",
        "input_ref",
        "priority",
        "labels",
        "idempotency_key",
        "deadline",
        "queue_ttl_s",
        "execution_timeout_s",
        "retention_s",
        "callback",
        "max_attempts",
        "correlation_id",
    }
)


@dataclass(frozen=True, slots=True)
class Signatures:
    """Model signatures, used only to pick datatypes and shapes (the gateway validates for real):
    from the gateway (ListModels), or from a local configuration file when one is given. A
    version's own (`by_version`) types a request pinned to it: a `[[models.versions]]` entry may
    take other inputs than the model's default, and `submit --version 2` was typed by the
    default's (`-i 'x=[[1,2,3,4]]'` sent FP32 to a version taking INT64, refused)."""

    by_model: Mapping[str, ModelSignature]
    served: bool = False  # the gateway's ListModels: a model not in it is one the gateway refuses
    # (model, version) -> that version's signature, where ListModels or the file gives one.
    by_version: Mapping[tuple[str, str], ModelSignature] = field(default_factory=dict)

    @classmethod
    async def fetch(cls, config_path: Path | None, client: AsyncClient) -> Signatures:
        """--config's models when given, else what the gateway says it serves (a gateway too old
        to say: the local default configuration's, as before ListModels)."""
        if config_path is not None:
            return cls.load(config_path)
        try:
            models = await client.models()
        except UnimplementedError:
            return cls.load(None)
        return cls(
            {m.name: ModelSignature(inputs=m.inputs, outputs=m.outputs) for m in models},
            served=True,
            by_version={
                (m.name, v.version): ModelSignature(inputs=v.inputs, outputs=v.outputs)
                for m in models
                for v in m.versions
                if v.inputs  # an older gateway lists no inputs per version: the model's then
            },
        )

    @classmethod
    def load(cls, config_path: Path | None) -> Signatures:
        # Here: the configuration's classes are a quarter of the client commands' start (pydantic).
        from asyncinfer.config import load_config

        try:
            config = load_config(config_path)
        except AsyncInferError as exc:
            if config_path is not None:
                raise UsageError(exc.message) from None
            return cls({})  # the environment's overrides do not parse: guess from the values instead
        return cls(
            {model.name: model.signature for model in config.models},
            by_version={
                (model.name, version.version): version.signature
                for model in config.models
                for version in model.version_configs()
            },
        )

    def require(self, model: str) -> None:
        """NotFoundError, as the gateway answers it, for a model the gateway does not serve: its
        inputs were read without a signature, and `-i text=hello` for one said "--input text is
        not valid JSON" (a usage error) rather than that the model is not there."""
        if self.served and model not in self.by_model:
            known = ", ".join(sorted(self.by_model)) or "none"
            raise NotFoundError(
                f"unknown model {model[:64]!r}; the models served are: {known}",
                code=grpc.StatusCode.NOT_FOUND,
                reason="MODEL_NOT_FOUND",
                metadata={"model": model[:64], "known_models": known},
            )

    def spec(self, model: str, name: str, version: str = "") -> TensorSpec | None:
        """Input `name`'s spec in `version`'s signature where known, else in the model's."""
        signature = self.by_version.get((model, version)) if version else None
        signature = signature or self.by_model.get(model)
        if signature is None:
            return None
        return next((spec for spec in signature.inputs if spec.name == name), None)


def parse_key_values(items: Sequence[str], what: str) -> dict[str, str]:
    """["k=v", ...] as a dict; UsageError naming `what` for an item without '='."""
    result: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{what} must look like KEY=VALUE, got {item!r}")
        result[key] = value
    return result


LABEL_HELP = "a label (repeatable); the first '=' ends the key, the value may hold more"


def text_argument(text: str) -> str:
    """The type of every argument sent to the gateway or the scheduler as text (a model, a version,
    an ID, a reason, a URL, an instance name): UTF-8 text. Bytes of an argument that are not UTF-8
    reach Python as lone surrogates (U+DC80-U+DCFF, one a byte), which protobuf refuses with a
    traceback once the call is made; as a type, argparse says it as a usage error (exit 2) naming
    the flag, before anything is sent."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        byte = ord(text[exc.start]) - 0xDC00 if 0xDC80 <= ord(text[exc.start]) <= 0xDCFF else None
        what = f"byte 0x{byte:02X}" if byte is not None else f"character {text[exc.start]!r}"
        raise argparse.ArgumentTypeError(
            f"not UTF-8 text ({what} at position {exc.start}); it is sent as UTF-8: "
            "is the terminal's or the script's encoding another?"
        ) from None
    return text


def label_argument(text: str) -> str:
    """--label's type: KEY=VALUE, split at the first '=' (the value may hold more, or be empty; the
    key may not be empty), in UTF-8 text. Any other character is the gateway's to judge (it limits
    bytes, not characters), and none is normalized: a label matches only the same code points."""
    text_argument(text)
    key, sep, _ = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"give KEY=VALUE (a value may be empty, a key not), not {text!r}")
    return text


def idempotency_key_argument(text: str) -> str:
    """--idempotency-key's type: UTF-8 text, not empty. An empty one was taken as none given: a
    command run with an unset variable (`--idempotency-key "$KEY"`) queued anew each time."""
    text_argument(text)
    if not text:
        raise argparse.ArgumentTypeError("it is empty (an unset variable?): give a key, or leave the option out")
    return text


def input_argument(text: str) -> str:
    """--input's type: NAME=VALUE whose NAME, and VALUE unless it names a file (@PATH: a path is
    the file system's bytes, read here, never sent), are UTF-8 text."""
    name, sep, value = text.partition("=")
    text_argument(name)
    if sep and not value.startswith("@"):
        text_argument(text)
    return text


def any_case_of(choices: Sequence[str]) -> Callable[[str], str]:
    """The type of an option that takes one of `choices` in any case (--priority): the choice, upper
    case. One not among them is refused as given: argparse's `choices` checked the value after
    `type=str.upper`, and so echoed `--priority urgent` as `invalid choice: 'URGENT'`, a value the
    user never typed. Keep `choices=` beside it for --help and completion."""

    def convert(text: str) -> str:
        if text.upper() not in choices:
            listed = ", ".join(repr(choice) for choice in choices)
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {listed}, in any case)")
        return text.upper()

    return convert


def header_argument(text: str) -> str:
    """--api-key's and --ops-key's type: sent as gRPC metadata, which takes printable ASCII only
    (grpcio raised UnicodeEncodeError or ExecuteBatchError, a traceback, at the first call)."""
    problem = header_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def header_problem(text: str) -> str | None:
    """Why a key cannot be sent as a gRPC header value, or None."""
    for position, character in enumerate(text):
        if not " " <= character <= "~":
            return (
                f"a key is printable ASCII (it is sent as a gRPC header); character {character!r} at position "
                f"{position} is not"
            )
    return None


def datatype_overrides(items: Sequence[str]) -> tuple[str | None, dict[str, str]]:
    """`--datatype FP32` (every input) and `--datatype x=FP32` (one input)."""
    every: str | None = None
    per_input: dict[str, str] = {}
    for item in items:
        name, sep, datatype = item.rpartition("=")
        datatype = datatype.upper()
        if datatype not in NUMPY_DTYPES and datatype != "BYTES":
            raise UsageError(f"unknown datatype {datatype!r}; one of {', '.join(sorted([*NUMPY_DTYPES, 'BYTES']))}")
        if sep:
            per_input[name] = datatype
        else:
            every = datatype
    return every, per_input


def read_value(text: str, where: str = "the value", stdin: Callable[[], str] = lambda: sys.stdin.read()) -> Any:
    """An inline value: JSON, or @file.npy / @file (JSON) / @- (JSON on stdin). A .npy file gives
    a numpy array, JSON gives plain Python values."""
    if text.startswith("@"):
        source = text[1:]
        if source == "-":
            return read_json(stdin(), "stdin")
        path = Path(source)
        try:
            if path.suffix == ".npy":
                return np.load(path, allow_pickle=False)
            return read_json(path.read_text(), str(path))
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise UsageError(f"{path} is not a numpy array file: {exc}") from None
    return read_json(text, where)


def read_json(text: str, where: str) -> Any:
    """`text` as JSON; a UsageError naming `where` (a flag, a file, stdin) when it is not."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where} is not valid JSON: {exc}") from None


def _infer_datatype(value: Any) -> str:
    flat = np.asarray(value, dtype=object).ravel().tolist() if isinstance(value, list) else [value]
    if flat and all(isinstance(v, bool) for v in flat):
        return "BOOL"
    if flat and all(isinstance(v, str | bytes) for v in flat):
        return "BYTES"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
        return "INT64"
    return "FP32"


def to_array(
    name: str,
    value: Any,
    *,
    spec: TensorSpec | None,
    datatype: str | None = None,
    shape: Sequence[int] | None = None,
) -> npt.NDArray[Any]:
    """One input's value as a numpy array of the datatype and shape the model expects."""
    if isinstance(value, dict):
        unknown = value.keys() - {"datatype", "shape", "data"}
        if unknown or "data" not in value:
            raise UsageError(f"input {name!r}: a tensor object has 'data' (and optionally 'datatype', 'shape')")
        datatype = str(value.get("datatype") or "").upper() or datatype
        shape = value.get("shape") or shape
        value = value["data"]
    wanted = datatype or (spec.datatype if spec is not None else None)
    given = datatype  # --datatype's or the tensor's own; None: the signature's or the JSON's
    try:
        if isinstance(value, np.ndarray):
            array: npt.NDArray[Any] = value
            # Cast a file's array to the signature's datatype only where no value is lost in kind.
            typed = typed_as(array, wanted) if wanted else None
            if typed is not None:
                array = typed
        else:
            wanted = wanted or _infer_datatype(value)
            # np.array([true, 2.5], dtype=float32) is [1.0, 2.5] and np.array([2, 0], dtype=bool)
            # [True, False]: a mistake, sent as if meant.
            if misplaced := booleans_misplaced(value, wanted):
                raise UsageError(f"input {name!r} {misplaced}")
            if wanted == "BYTES":
                array = np.array(_encode_strings(value), dtype=object)
            else:
                # numpy's cast changes what it cannot hold: 1.5 as INT64 is 1, 300 as UINT8 44, -1
                # 255, 1e300 as FP32 inf, each sent as if typed so. A whole float (2.0) is refused
                # for an integer input, as the SDK and a JSONL batch line refuse it.
                if changed := cast_change(np.asarray(value), wanted, value):
                    raise UsageError(f"input {name!r} {changed}; {_takes(name, wanted, spec, given)}")
                array = np.array(value, dtype=NUMPY_DTYPES[wanted])
        if shape:
            array = array.reshape(tuple(int(d) for d in shape))
        elif spec is not None:
            array = as_one_row(array, spec)
    except KeyError:
        raise UsageError(f"input {name!r}: unknown datatype {wanted!r}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        # numpy's words ("could not convert string to float: 'a'", "setting an array element with
        # a sequence. The requested array has an inhomogeneous shape ..."), with what the input takes.
        why = f" {RAGGED_REASON}" if "inhomogeneous" in str(exc) else f": {exc}"
        takes = f"; {_takes(name, wanted, spec, given)}" if wanted else ""
        raise UsageError(f"input {name!r}{why}{takes}") from None
    return array


def _takes(name: str, datatype: str, spec: TensorSpec | None, given: str | None) -> str:
    """What the input takes and where that came from, for a refusal of a value that does not fit."""
    if spec is not None and given in (None, spec.datatype):
        return f"the model takes {spec.summary()}"
    if given is not None:
        return f'it is given as {datatype} (--datatype, or the tensor\'s own "datatype")'
    return f"no signature names its datatype, and its JSON reads as {datatype}: give --datatype {name}=TYPE"


def _encode_strings(value: Any) -> Any:
    if isinstance(value, list):
        return [_encode_strings(v) for v in value]
    return value.encode() if isinstance(value, str) else value


def inputs_from_arguments(
    model: str,
    items: Sequence[str],
    *,
    signatures: Signatures,
    datatypes: Sequence[str] = (),
    shapes: Sequence[str] = (),
    version: str = "",
) -> dict[str, npt.NDArray[Any]]:
    """`--input NAME=VALUE` arguments (with `--datatype` / `--shape`) as arrays, typed by
    `version`'s signature (empty: the model's)."""
    every, per_input = datatype_overrides(datatypes)
    shape_by_input = {k: _shape(v, k) for k, v in parse_key_values(shapes, "--shape").items()}
    arrays: dict[str, npt.NDArray[Any]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--input must look like NAME=VALUE, NAME=@file.npy or NAME=@-, got {item!r}")
        spec = signatures.spec(model, name, version)
        datatype = per_input.get(name, every)
        arrays[name] = to_array(
            name,
            _text_or_value(
                text,
                f"--input {name}",
                bytes_input=(datatype or (spec and spec.datatype)) == "BYTES",
                hint=partial(_value_hint, model, name, text, spec),
            ),
            spec=spec,
            datatype=datatype,
            shape=shape_by_input.get(name),
        )
    return arrays


def _text_or_value(text: str, where: str, *, bytes_input: bool, hint: Callable[[], str]) -> Any:
    """read_value's, except for a text (BYTES) input: a value that is not JSON is the text itself
    (`-i text=hello` as well as `-i 'text="hello"'` or `-i 'text=["a", "b"]'`), and a file that is
    not .npy or .json is one text, whole (`-i text=@doc.txt`). Another input's value that is not
    JSON is a usage error with the hint (what to give)."""
    if not bytes_input:
        if not text.startswith("@"):
            try:
                return json.loads(text)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{where} is not valid JSON ({exc}); {hint()}") from None
        return read_value(text, where)
    if not text.startswith("@"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    path = Path(text[1:])
    if text == "@-" or path.suffix in (".npy", ".json"):
        return read_value(text, where)
    try:
        return path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text: {exc}") from None


def _value_hint(model: str, name: str, text: str, spec: TensorSpec | None) -> str:
    """What to give instead of a value that is not JSON: the value in brackets when that is JSON
    (`-i x=1,2,3,4` said only `Extra data: line 1 column 2 (char 1)`), else a JSON array; then what
    the model takes, when its signature is known, and the file forms."""
    try:
        json.loads(f"[{text}]")
        example = f"did you mean -i '{name}=[{text}]'?"
    except json.JSONDecodeError:
        example = f"give a JSON value, as -i '{name}=[[1, 2, 3]]'"
    takes = ""
    if spec is not None:
        shape = ", ".join(str(d) for d in spec.shape)
        takes = f"model {model!r} takes {name}: {spec.datatype} of shape [{shape}]; -1: any size; "
    return f"{example} ({takes}or a file: -i {name}=@array.npy, -i {name}=@values.json)"


def _shape(text: str, name: str) -> list[int]:
    try:
        return [int(d) for d in text.replace("x", ",").split(",") if d.strip()]
    except ValueError:
        raise UsageError(f"--shape {name}= wants integers like 2,4, got {text!r}") from None


def request_from_json(
    data: Any, *, signatures: Signatures, default_model: str = "", idempotency_key: str = ""
) -> JobRequest:
    """A JSON request (a request file, stdin, a bulk line) as a `JobRequest`.

    {"model": "demo", "inputs": {"x": [[1, 2, 3, 4]]}, "priority": "HIGH", "labels": {"k": "v"},
     "queue_ttl_s": 60, "execution_timeout_s": 10, "retention_s": 3600, "max_attempts": 2,
     "callback": "https://...", "idempotency_key": "...", "input_ref": "..."}
    "inputs" may also be a list of {"name", "datatype", "shape", "data"} objects."""
    if not isinstance(data, dict):
        raise UsageError('a request is a JSON object like {"model": "demo", "inputs": {"x": [[1, 2, 3, 4]]}}')
    unknown = sorted(data.keys() - REQUEST_KEYS)
    if unknown:
        close = [m for key in unknown for m in difflib.get_close_matches(str(key), sorted(REQUEST_KEYS), n=1)]
        meant = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise UsageError(
            f"unknown request fields: {', '.join(unknown)}{meant} (known: {', '.join(sorted(REQUEST_KEYS))})"
        )
    model = str(data.get("model") or data.get("model_name") or default_model)
    if not model:
        raise UsageError('the request names no model (give "model" in it, or the model on the command line)')
    raw_inputs = data.get("inputs")
    version = str(data.get("model_version") or "")
    inputs: dict[str, npt.NDArray[Any]] | None = None
    if isinstance(raw_inputs, list):
        inputs = {}
        for tensor in raw_inputs:
            if not isinstance(tensor, dict) or "name" not in tensor:
                raise UsageError('each item of a list of inputs is {"name", "datatype", "shape", "data"}')
            fields = {k: v for k, v in tensor.items() if k != "name"}
            inputs[str(tensor["name"])] = to_array(
                str(tensor["name"]), fields, spec=signatures.spec(model, str(tensor["name"]), version)
            )
    elif isinstance(raw_inputs, dict):
        inputs = {
            str(name): to_array(str(name), value, spec=signatures.spec(model, str(name), version))
            for name, value in raw_inputs.items()
        }
    elif raw_inputs is not None:
        raise UsageError('"inputs" is an object (name -> value) or a list of tensors')
    try:
        labels = data.get("labels") or {}
        if not isinstance(labels, dict):
            raise UsageError('"labels" is an object of strings')
        return JobRequest(
            model=model,
            inputs=inputs,
            input_ref=str(data.get("input_ref") or ""),
            model_version=version,
            priority=_field(data, "priority", _priority, "one of HIGH, NORMAL, LOW (any case)"),
            idempotency_key=str(data.get("idempotency_key") or idempotency_key),
            labels={str(k): str(v) for k, v in labels.items()},
            deadline=_field(data, "deadline", _time, "an ISO 8601 time, like 2026-12-07T14:03:21Z"),
            queue_ttl_s=_field(data, "queue_ttl_s", _seconds, SECONDS),
            execution_timeout_s=_field(data, "execution_timeout_s", _seconds, SECONDS),
            retention_s=_field(data, "retention_s", _seconds, SECONDS),
            callback=_callback(data.get("callback")),
            max_attempts=_field(data, "max_attempts", _whole, "a whole number") or 0,
            correlation_id=str(data.get("correlation_id") or ""),
        )
    except (ValueError, TypeError) as exc:
        raise UsageError(f"bad request field: {exc}") from None


SECONDS = "seconds, a number"
T = TypeVar("T")


def _field(data: Mapping[str, Any], key: str, convert: Callable[[Any], T], wants: str) -> T | None:
    """The request's `key` converted, None when it is absent (or null, or ""); a UsageError naming
    the field, its value and what it takes otherwise. It was Python's words alone: "bad request
    field: 'URGENT' is not a valid Priority", "could not convert string to float: 'abc'"."""
    value = data.get(key)
    if value is None or value == "":
        return None
    try:
        return convert(value)
    except (ValueError, TypeError, OverflowError):
        raise UsageError(f'request field "{key}" is {json.dumps(value)}: it takes {wants}') from None


def _priority(value: Any) -> Priority:
    if not isinstance(value, str):
        raise TypeError(value)
    return Priority(value.upper())


def _time(value: Any) -> datetime:
    if not isinstance(value, str):
        raise TypeError(value)
    return datetime.fromisoformat(value)


def _seconds(value: Any) -> float:
    if isinstance(value, bool):  # float(true) is 1.0
        raise TypeError(value)
    return float(value)


def _whole(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(value)  # int(2.5) is 2: sent as if written so
    return int(value)


def _callback(value: Any) -> Callback | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return Callback(value)
    if isinstance(value, dict) and "url" in value:
        return Callback(str(value["url"]), tuple(CallbackEvent(str(e).upper()) for e in value.get("events", ())))
    raise UsageError('"callback" is a URL or {"url": ..., "events": [...]}')
