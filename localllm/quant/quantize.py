"""GGUF quantization through llama.cpp's own quantizer (`llama_model_quantize`), what `create --quantize` runs.

The work happens in a worker process (`python -m localllm.quant.quantize JOB`): quantizing takes every core for
a while, llama.cpp aborts the process on some malformed inputs, and a process can be stopped when the client goes
away. The parent (`run_quantize`, a generator the server's pump thread drives) checks the request first, reads the
worker's JSON lines into progress, and returns the quality report the worker measured (quality.py).

Worker lines: {"progress": bytes of source tensors done, "total": all of them}, {"status": text},
{"report": QuantizationReport}, {"error": message}."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import gguf

from .. import api
from ..errors import InvalidInput, LocalLLMError, ModelFormatError

# The usual llama.cpp quantization types (llama-quantize's names), each a llama_ftype from the gguf package.
QUANT_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q6_K",
    "Q5_K_M",
    "Q5_K_S",
    "Q5_1",
    "Q5_0",
    "Q4_K_M",
    "Q4_K_S",
    "Q4_1",
    "Q4_0",
    "Q3_K_L",
    "Q3_K_M",
    "Q3_K_S",
    "Q2_K",
    "Q2_K_S",
    "IQ4_XS",
    "IQ4_NL",
    "IQ3_M",
    "IQ3_S",
    "IQ3_XS",
    "IQ3_XXS",
    "IQ2_M",
    "IQ2_S",
    "IQ2_XS",
    "IQ2_XXS",
    "IQ1_M",
    "IQ1_S",
)
ALIASES = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "FP16": "F16", "FP32": "F32"}
# Types whose few bits per weight give garbage without an importance matrix (llama.cpp refuses them too).
NEEDS_IMATRIX = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S"})
UNQUANTIZED = frozenset({"F32", "F16", "BF16"})
# llama.cpp's per-tensor log line: "[  12/ 272] blk.0.attn_k.weight  - [...], type = f16, ..."
_TENSOR_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")


def quant_type(name: str) -> str:
    """The canonical name of a quantization type (case-insensitive, Q4_K means Q4_K_M).

    Raises:
        InvalidInput: not a type llama.cpp's quantizer offers; the message lists them.
    """
    key = name.strip().upper()
    key = ALIASES.get(key, key)
    if key not in QUANT_TYPES:
        raise InvalidInput(
            f"quantize type {name!r} is not known",
            hint=f"use one of {', '.join(t.lower() if t.startswith('Q') else t for t in QUANT_TYPES)}",
        )
    return key


def _ftype(qtype: str) -> int:
    prefix = "ALL_" if qtype == "F32" else "MOSTLY_"
    return int(gguf.LlamaFileType[prefix + qtype])


def check_quantize(source: Path, qtype: str, *, allow_requantize: bool, imatrix: Path | None, label: str) -> None:
    """Refuse, before any work, what the quantizer would refuse or what would ruin the model.

    Raises:
        InvalidInput: a quantized source without allow_requantize, a type that needs an imatrix without one, or an
            imatrix file that is missing.
        ModelFormatError: the source is not a readable GGUF.
    """
    from .gguf import inspect_gguf

    info = inspect_gguf(source)
    quantized = sorted(set(info.tensor_types) - UNQUANTIZED)
    if quantized and not allow_requantize:
        raise InvalidInput(
            f"{label} is already quantized ({info.file_type}: {', '.join(quantized)} tensors); "
            f"quantizing it again to {qtype} compounds the error",
            hint="quantize from an F16, BF16 or F32 GGUF, or pass --allow-requantize "
            "(allow_requantize) to do it anyway",
        )
    if qtype in NEEDS_IMATRIX and imatrix is None:
        raise InvalidInput(
            f"{qtype} needs an importance matrix: without one the result is garbage",
            hint="make one with llama-imatrix and pass --imatrix PATH, or pick q4_K_M or larger",
        )
    if imatrix is not None and not imatrix.is_file():
        raise InvalidInput(f"imatrix file {imatrix} does not exist")


def run_quantize(
    source: Path,
    out: Path,
    qtype: str,
    *,
    label: str,
    allow_requantize: bool = False,
    imatrix: Path | None = None,
    threads: int = 0,
    report_tokens: int = 2048,
) -> Generator[api.PullProgress, None, api.QuantizationReport | None]:
    """Quantize `source` (a GGUF, the first part of a split one) into `out` in a worker process, yielding progress;
    return the quality report measured on `report_tokens` tokens (None when 0).

    Raises:
        InvalidInput / ModelFormatError: as check_quantize, or the quantizer's own refusal (its message).
        LocalLLMError: the worker died.
    """
    qtype = quant_type(qtype)
    check_quantize(source, qtype, allow_requantize=allow_requantize, imatrix=imatrix, label=label)
    job = {
        "source": str(source),
        "out": str(out),
        "qtype": qtype,
        "allow_requantize": allow_requantize,
        "imatrix": str(imatrix) if imatrix else None,
        "threads": threads,
        "report_tokens": report_tokens,
        "label": label,
    }
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "localllm.quant.quantize", json.dumps(job)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            result = yield from _follow(process, qtype)
        finally:
            if process.poll() is None:  # the consumer stopped early (client gone): stop the work too
                process.kill()
            process.wait()
        if process.returncode != 0 and result.get("error") is None:
            stderr.seek(0)
            tail = stderr.read().decode("utf-8", "replace").strip().splitlines()[-3:]
            raise LocalLLMError(f"the quantize worker exited with status {process.returncode}: {' / '.join(tail)}")
    if result.get("error"):
        raise result["error"]
    return api.QuantizationReport.model_validate(result["report"]) if result.get("report") else None


def _follow(process: subprocess.Popen, qtype: str) -> Generator[api.PullProgress, None, dict[str, Any]]:
    result: dict[str, Any] = {}
    assert process.stdout is not None
    for line in process.stdout:
        message = json.loads(line)
        if "progress" in message:
            yield api.PullProgress(
                status=f"quantizing to {qtype}", total=message["total"], completed=message["progress"]
            )
        elif "status" in message:
            yield api.PullProgress(status=message["status"])
        elif "report" in message:
            result["report"] = message["report"]
        elif "error" in message:
            kind = InvalidInput if message.get("kind") == "input" else ModelFormatError
            result["error"] = kind(message["error"], hint=message.get("hint"))
    return result


# ---------------------------------------------------------------------------------------------------------- worker


def read_imatrix(path: Path) -> dict[str, Any]:
    """An importance matrix GGUF (llama-imatrix's output) as {tensor name: float32 weights}, normalised as
    llama-quantize does (each sum of squares divided by its count; 1 where nothing was counted)."""
    import numpy as np

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise InvalidInput(
            f"imatrix {path} is not a GGUF importance matrix: {exc}",
            hint="write it with llama-imatrix (its default GGUF output)",
        ) from None
    tensors = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1) for t in reader.tensors}
    result = {}
    for name in (n.removesuffix(".in_sum2") for n in tensors if n.endswith(".in_sum2")):
        sums, counts = tensors[f"{name}.in_sum2"], tensors.get(f"{name}.counts")
        if counts is None or not counts.size or sums.size % counts.size:
            raise InvalidInput(f"imatrix {path}: {name} has sums but no matching counts")
        per_expert = sums.reshape(counts.size, -1)
        scale = np.where(counts > 0, counts, 1.0)[:, None]
        values = np.where(counts[:, None] > 0, per_expert / scale, 1.0).astype(np.float32).reshape(-1)
        if not np.isfinite(values).all():
            raise InvalidInput(f"imatrix {path}: {name} holds values that are not finite")
        result[name] = values
    if not result:
        raise InvalidInput(f"imatrix {path} holds no importance data (no *.in_sum2 tensors)")
    return result


_log_callback = None


class _QuantizeLog:
    """llama.cpp's log during quantization: per-tensor lines become progress, errors are kept for the message."""

    def __init__(self, sizes: dict[str, int], emit: Callable[[dict], None]):
        self.sizes, self.emit = sizes, emit
        self.total = sum(sizes.values())
        self.done = 0
        self.errors: list[str] = []

    def __call__(self, level: int, text: bytes, _user) -> None:
        line = (text or b"").decode("utf-8", "replace")
        match = _TENSOR_LINE.match(line)
        if match:
            self.done += self.sizes.get(match.group(3), 0)
            self.emit({"progress": self.done, "total": self.total})
        elif level == 4 and line.strip():  # GGML_LOG_LEVEL_ERROR
            self.errors.append(line.strip())

    def error(self) -> str:
        failed = [e.split("failed to quantize:", 1)[1].strip() for e in self.errors if "failed to quantize:" in e]
        return failed[-1] if failed else (self.errors[-1] if self.errors else "llama.cpp gave no reason")


def quantize_file(
    source: Path,
    out: Path,
    qtype: str,
    *,
    allow_requantize: bool,
    imatrix: Path | None,
    threads: int,
    emit: Callable[[dict], None],
) -> None:
    """Run llama_model_quantize in this process (the worker), emitting progress by source bytes."""
    import llama_cpp

    from .gguf import inspect_gguf

    sizes = inspect_gguf(source).tensor_sizes  # every part's, for a split source
    log = _QuantizeLog(sizes, emit)
    global _log_callback  # llama.cpp keeps the pointer: the ctypes object must outlive this call
    _log_callback = llama_cpp.llama_log_callback(log)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = _ftype(qtype)
    params.allow_requantize = allow_requantize
    keep = None
    if imatrix is not None:
        keep = _imatrix_array(read_imatrix(imatrix))
        params.imatrix = keep[0]
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise ModelFormatError(f"llama.cpp could not quantize to {qtype}: {log.error()}")
    del keep


def _imatrix_array(data: dict[str, Any]):
    """A NULL-terminated llama_model_imatrix_data array over `data` (returned with what keeps its memory alive)."""
    import llama_cpp

    entries = (llama_cpp.llama_model_imatrix_data * (len(data) + 1))()
    names = []
    for entry, (name, values) in zip(entries, data.items()):
        names.append(name.encode())
        entry.name = names[-1]
        entry.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entry.size = values.size
    return ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data)), entries, names, data


def _emit(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    if hasattr(os, "nice"):
        os.nice(10)  # below the server's own threads: answers keep flowing while this works
    job = json.loads(argv[1])
    source, out = Path(job["source"]), Path(job["out"])
    try:
        quantize_file(
            source,
            out,
            job["qtype"],
            allow_requantize=job["allow_requantize"],
            imatrix=Path(job["imatrix"]) if job["imatrix"] else None,
            threads=job["threads"],
            emit=_emit,
        )
        if job["report_tokens"]:
            from .quality import measure_quality

            report = measure_quality(
                source,
                out,
                qtype=job["qtype"],
                label=job["label"],
                threads=job["threads"],
                tokens=job["report_tokens"],
                emit=_emit,
            )
            _emit({"report": report.model_dump(mode="json")})
    except LocalLLMError as exc:
        _emit({"error": exc.message, "hint": exc.hint, "kind": "input" if isinstance(exc, InvalidInput) else "format"})
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv))
