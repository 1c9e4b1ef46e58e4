"""The on-disk dump format: every name, attribute and encoding, specified once.

This module is torch-free; the dumper writes with it and the compare side reads with it.
``docs/format.md`` is the prose version of this file; keep the two in step and bump
``FORMAT_VERSION`` on any incompatible change.
"""
from __future__ import annotations

import fnmatch
import math
import re
from typing import Iterable, NamedTuple, Optional, Union

import numpy as np

FORMAT_NAME = "h5cmp-dump"
FORMAT_VERSION = 12
# version 1: no sketch columns (read as NaN); versions 1-2: no data checksums, no `incomplete`;
# versions 1-4: no `micro_batch` (read as NO_MICRO_BATCH); versions 1-5: no `injected` (read as
# 0) and no `injected_from` attribute (read as ""); versions 1-6: no `digest` (read as
# NO_DIGEST); versions 1-7: no sharding columns (read as "": not sharded); versions 7-8: hash
# mode's parameter rows hold statistics and a sketch besides their digest, other modes' no
# digest (all read as they are: see comparison._PairRef.hashed); versions 1-9: no `addends`
# (read as ""); versions 1-10: no `grad_scale` (read as 1.0: no loss scale); versions 2-11: 8
# sketch sums, not SKETCH_SIZE (the others read as NaN; compare.statistics.sketch_sums). Files
# of any version may lack the normalization eps rows (EPS_PATH, written since 2026-11-26) and the
# convolution geometry rows (CONV_PATH, since 2026-11-27).
# Version 3 (a development version of 2026-11-23, crc32 data checksums) is not read.
SUPPORTED_VERSIONS = frozenset({1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12})

# ---- files -------------------------------------------------------------------------
FILE_SUFFIX = ".hdf5"
TEMP_SUFFIX = ".tmp"
LOCK_SUFFIX = ".lock"
_STEP_FILE_RE = re.compile(
    r"^(?P<epoch>\d+)-epoch_(?P<step>\d+)-step(?:_rank(?P<rank>\d+))?_dump\.hdf5$"
)


def step_file_name(epoch: int, step: int, rank: Optional[int] = None) -> str:
    """Final name of one step's file: ``{epoch}-epoch_{step}-step[_rank{r}]_dump.hdf5``."""
    rank_part = "" if rank is None else f"_rank{rank}"
    return f"{epoch}-epoch_{step}-step{rank_part}_dump{FILE_SUFFIX}"


def temp_file_name(final_name: str, writer: str) -> str:
    """Name a step file carries while ``writer`` (unique per writer of a step: process id and a
    random token) writes it: hidden, never matches a dump."""
    return f".{final_name}.{writer}{TEMP_SUFFIX}"


def lock_file_name(final_name: str) -> str:
    """Name of the file a writer of step file ``final_name`` holds locked while it writes it."""
    return f".{final_name}{LOCK_SUFFIX}"


def parse_step_file_name(name: str) -> Optional[tuple[int, int, Optional[int]]]:
    """``(epoch, step, rank)`` of a final step-file name, or None for any other name."""
    m = _STEP_FILE_RE.match(name)
    if m is None:
        return None
    rank = m.group("rank")
    return int(m.group("epoch")), int(m.group("step")), None if rank is None else int(rank)


def is_temp_file_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX) and FILE_SUFFIX in name


# ---- inside a file -----------------------------------------------------------------
def step_group_name(epoch: int, step: int) -> str:
    return f"{epoch}-epoch_{step}-step"


def call_group_name(call: int, module_key: str) -> str:
    """Group of one module call, e.g. ``0018_layer1.0.bn1.BatchNorm2d``."""
    return f"{call:04d}_{module_key.replace('/', '|')}"


OP_SEPARATOR = "/"
_OP_NAME = re.compile(r".+#\d+'*")  # an op's name and number, primed if one side's


def op_module(module: str, op: str, number: int) -> str:
    """``module`` column of an op record (``dumper.ops``): the path of the module whose own code
    ran it, the op's name and its number among that call's ops of the name, e.g.
    ``model.layers.1.self_attn/softmax#0``; ``cls`` holds the op's name."""
    return f"{module}{OP_SEPARATOR}{op}#{number}"


def split_op(module: str) -> Optional[tuple[str, str]]:
    """``(module path, "op#n")`` of an op record's ``module`` (``"op#n'"`` where alignment
    marked it one side's); None for a module record (whose name may hold a ``/``)."""
    path, sep, op = module.rpartition(OP_SEPARATOR)
    return (path, op) if sep and _OP_NAME.fullmatch(op) else None


def contains(outer: str, inner: str) -> bool:
    """Whether module (or op) path ``inner`` is inside module ``outer``: a submodule, or an op
    run by it or by a submodule; the root, path ``""``, contains everything."""
    return outer == "" or inner.startswith((outer + ".", outer + OP_SEPARATOR))


def module_key(path: str, cls: str) -> str:
    """Key of a module: its path in the model and its class; the root is its class alone. An
    op record's key is its ``module`` (which names the op)."""
    if split_op(path) is not None:
        return path
    return f"{path}.{cls}" if path else cls


def record_label(module: str, cls: str, call_idx: int, kind: str, index: int,
                 occurrence: int = 0) -> str:
    """How reports name a record: ``blocks.0.attn.Linear#0 output[0]``; an op record
    ``blocks.0.attn#0/softmax#1 output[0]`` (the module's call, then the op's number in it);
    ``@n`` appended for the n-th repeat of a gradient."""
    repeat = f"@{occurrence}" if occurrence else ""
    op = split_op(module)
    where = f"{module_key(module, cls)}#{call_idx}" if op is None else \
        f"{op[0]}#{call_idx}{OP_SEPARATOR}{op[1]}"
    return f"{where} {kind}[{index}]{repeat}"


def row_label(row) -> str:
    """:func:`record_label` of a result row (any mapping with the record's columns)."""
    return record_label(row["module"], row["cls"], row["call_idx"], row["kind"], row["index"],
                        row["occurrence"])


def in_step_of(frame, row):
    """Which rows of ``frame`` are of ``row``'s step and rank (rank NaN: not distributed)."""
    rank = row["rank"]
    rank = -1 if rank is None or (isinstance(rank, float) and math.isnan(rank)) else rank
    return ((frame["epoch"] == row["epoch"]) & (frame["step"] == row["step"])
            & (frame["rank"].fillna(-1) == rank))


def later_records(frame, row, same_as: str = "same_as"):
    """The rows of ``frame`` that are later records of ``row``'s tensor: of its step and rank,
    with ``row``'s label in their ``same_as`` column (the verdict's, or a re-run table's
    ``local_same_as``)."""
    return frame[in_step_of(frame, row) & (frame[same_as] == row_label(row))]


def module_matches(path: str, cls: str, patterns) -> bool:
    """Whether a module's path or key (``path.Class``) matches any glob in ``patterns`` — the
    one rule for every module selection (dumper filters, injection, ``h5cmp --module``)."""
    names = (path, module_key(path, cls))
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


def dataset_name(kind: str, index: int, occurrence: int = 0) -> str:
    """``input_0``; a gradient delivered again by a later backward pass gets ``@n`` appended."""
    return f"{kind}_{index}" if occurrence == 0 else f"{kind}_{index}@{occurrence}"


INDEX_DATASET = "index"
# Group at the file's root holding a committed (named) datatype per `bits`-encoded dtype the
# file stores, e.g. /dtypes/bfloat16: its datasets use it, so HDF5 tools name the dtype. Since 7.
DTYPES_GROUP = "dtypes"

# Kinds of record. Forward kinds are written at forward time, backward kinds when autograd runs.
INPUT, OUTPUT, GRAD_INPUT, GRAD_OUTPUT, PARAM, PARAM_GRAD = (
    "input", "output", "grad_input", "grad_output", "param", "param_grad",
)
KINDS = (INPUT, OUTPUT, GRAD_INPUT, GRAD_OUTPUT, PARAM, PARAM_GRAD)
FORWARD_KINDS = frozenset({INPUT, OUTPUT, PARAM})
BACKWARD_KINDS = frozenset({GRAD_INPUT, GRAD_OUTPUT, PARAM_GRAD})
# A normalization's eps (its float attribute of one of these names: torch's, Hugging Face's
# RMSNorms'; torch's RMSNorm without one: its input dtype's machine epsilon), recorded with
# its parameters as a non-tensor `param` row (index -1) of this path, its repr as `value`:
# how much a normalization passes on of its input's error depends on it (compare.centering).
# Not for a module with running statistics outside training (a BatchNorm in eval mode
# normalizes by those: an affine map). Written since 2026-11-26 within format version 8: a
# row that older readers skip like every non-tensor leaf.
EPS_ATTRIBUTES = ("eps", "variance_epsilon")
EPS_PATH = "eps"
# A convolution's geometry (torch's Conv1d, Conv2d, Conv3d and ConvTranspose ones), recorded
# like eps, at its first call of the step, as a non-tensor `param` row of this path with
# `conv_text` as `value` (`dtype` `str`): what a convolution computes from its input and
# weight depends on it (compare.formulas). Written since 2026-11-27 within format version 8.
CONV_PATH = "conv"
CONV_PADDINGS = ("same", "valid")  # torch's padding by name; else one size per dimension


class ConvGeometry(NamedTuple):
    """How a convolution slides its kernel: per spatial dimension ``stride``, ``dilation``
    and ``padding`` (or one of ``CONV_PADDINGS``), its ``groups`` and torch's
    ``padding_mode`` (``zeros``, ``reflect``, ``replicate``, ``circular``)."""

    stride: tuple[int, ...]
    padding: Union[tuple[int, ...], str]
    dilation: tuple[int, ...]
    groups: int
    padding_mode: str


def conv_text(geometry: ConvGeometry) -> str:
    """``geometry`` as a ``value``: ``stride=2,2 padding=1,1 dilation=1,1 groups=1
    padding_mode=zeros``."""
    def sizes(v: Union[tuple, str]) -> str:
        return v if isinstance(v, str) else ",".join(str(int(n)) for n in v)
    return " ".join(f"{name}={sizes(value) if name != 'groups' else int(value)}"
                    for name, value in zip(ConvGeometry._fields, geometry))


def parse_conv(text: str) -> Optional[ConvGeometry]:
    """The geometry ``conv_text`` wrote, None where ``text`` is not one."""
    try:
        fields = dict(part.split("=", 1) for part in text.split(" "))
        padding = fields["padding"]
        sizes = {name: tuple(int(n) for n in fields[name].split(",")) for name in (
            "stride", "dilation", *(() if padding in CONV_PADDINGS else ("padding",)))}
        geometry = ConvGeometry(sizes["stride"], sizes.get("padding", padding),
                                sizes["dilation"], int(fields["groups"]),
                                fields["padding_mode"])
    except (ValueError, KeyError):
        return None
    lengths = {len(v) for v in (geometry.stride, geometry.dilation, geometry.padding)
               if not isinstance(v, str)}
    padding = () if isinstance(geometry.padding, str) else geometry.padding
    sizes_valid = min(geometry.stride + geometry.dilation + (geometry.groups,)) >= 1 and \
        min(padding, default=0) >= 0
    return geometry if len(lengths) == 1 and sizes_valid else None


STEP_SPEC = re.compile(r"\d+(?::\d+)?")  # how a step is asked for: S, or E:S


def step_label(epoch: int, step: int, rank=None) -> str:
    """How reports name a step: ``0:2``, with ``rank 1`` appended for a distributed one."""
    has_rank = rank is not None and rank == rank and rank >= 0  # None, NaN or -1: not distributed
    return f"{epoch}:{step}" + (f" rank {int(rank)}" if has_rank else "")


def direction_of(kind: str) -> str:
    """``"forward"`` or ``"backward"``: when records of ``kind`` are made."""
    return "backward" if kind in BACKWARD_KINDS else "forward"

# Encodings of a stored dataset.
ENC_RAW = "raw"    # stored in the numpy dtype of the same name as the torch dtype
ENC_BITS = "bits"  # the tensor's bytes reinterpreted as an unsigned/int type; decode by `dtype`
ENC_NONE = "none"  # no dataset: a non-tensor leaf (see `value`) or a dropped tensor
ENCODINGS = frozenset({ENC_RAW, ENC_BITS, ENC_NONE})

# Record status.
ST_OK, ST_DROPPED, ST_UNSUPPORTED = "ok", "dropped", "unsupported"

# `producer` of an input no hooked call made (or changed in place since), and of one that is
# a parameter of the model (a torch.nn.Parameter a call's code passes on: DeBERTa's relative
# position embeddings, a weight given to an op): its difference is the weights'
NO_PRODUCER, PRODUCER_PARAMETER = -1, -2


def holds_weights(kind, producer):
    """Whether a record holds weights (elementwise for pandas Series): a call's own
    (``param``), or a parameter its code hands on as an input (``PRODUCER_PARAMETER``)."""
    return (kind == PARAM) | ((kind == INPUT) & (producer == PRODUCER_PARAMETER))

# Columns of the per-step index table, in order: (name, kind), kind "str" = UTF-8 string
# (fixed-length as written by the dumper; readers also accept variable-length).
INDEX_COLUMNS: tuple[tuple[str, str], ...] = (
    ("seq", "int64"),         # global event number: orders forward and backward records
    ("call", "int32"),        # module-call number in this step (execution order of forward)
    ("module", "str"),        # module path in the model, "" for the root
    ("cls", "str"),           # module class name
    ("call_idx", "int32"),    # n-th call of this module in this step, from 0
    ("micro_batch", "int32"),  # n-th micro-batch of the step (cut by backward passes); since 5
    ("group", "str"),         # name of the call's group inside the step group
    ("kind", "str"),          # one of KINDS
    ("index", "int32"),       # n-th tensor of this kind in this call; -1 for non-tensor leaves
    ("occurrence", "int32"),  # 0; n for the n-th repeat of a gradient (backward run again)
    ("path", "str"),          # structural path of the leaf, e.g. args[0], kwargs['mask'], out['logits']
    ("dataset", "str"),       # dataset name inside the call group, "" if none
    ("dtype", "str"),         # torch dtype name (e.g. bfloat16); Python type name for non-tensors
    ("shape", "str"),         # comma-separated sizes, "" for a 0-d tensor
    ("encoding", "str"),      # one of ENCODINGS
    ("device", "str"),        # device the tensor lived on
    ("requires_grad", "int8"),
    ("status", "str"),        # ST_OK / ST_DROPPED / ST_UNSUPPORTED
    ("value", "str"),         # short repr of a non-tensor leaf (CONV_PATH: conv_text), or why not stored
    # input rows: `call` of the module call that output this tensor, else NO_PRODUCER, or
    # PRODUCER_PARAMETER for a parameter of the model (since 2026-11-29: earlier files have
    # NO_PRODUCER there)
    ("producer", "int32"),
    # input rows without a producer, and output rows a call made by its own code: the hooked
    # calls' outputs the tensor sums unchanged (addends_text), "" for none. Since 10.
    ("addends", "str"),
    # 1: the call ran on the reference's value instead of this one, which is what arrived
    # (an input, a parameter or an incoming gradient; see ATTR_INJECTED_FROM). Since 6.
    ("injected", "int8"),
    # the factor a BACKWARD_KINDS row's values (and statistics) carry: the loss scale of a
    # GradScaler (HookerAndDumper's scaler=) the gradient was computed under; NO_GRAD_SCALE
    # elsewhere. Since 11.
    ("grad_scale", "float64"),
    # Statistics (statistics mode; NaN where not computed). Counts are exact below 2**53.
    ("stat_min", "float64"),
    ("stat_max", "float64"),
    ("stat_mean", "float64"),
    ("stat_std", "float64"),  # population standard deviation
    ("stat_norm", "float64"),  # L2 norm
    ("stat_nan", "float64"),  # number of NaN elements
    ("stat_inf", "float64"),  # number of +-Inf elements
    ("stat_zero", "float64"),  # number of zero elements
    # Sketch (parameter statistics; NaN where not computed): SKETCH_SIZE signed sums, see
    # compare.statistics.sketch_of_chunks. The first 8 since format version 2, 32 since 12.
    *((f"sketch_{k}", "float64") for k in range(32)),
    # the dataset's checksum (data_checksum), -1 for a row without a dataset. Since version 4.
    ("checksum", "int64"),
    # the tensor's digest, the `checksum` its dataset would have (data_checksum of its bytes),
    # with no dataset: hash mode's rows and, since version 9, parameter rows without values;
    # -1 elsewhere. Since version 7.
    ("digest", "int64"),
    # A sharded tensor (a DTensor, or a plain tensor marked as a shard): the row's values are
    # this rank's shard. The device mesh's shape, its placements (one per mesh dimension,
    # PLACEMENT_SEPARATOR-joined: S(d) sharded along d, R replicated, P(op) partial), the global
    # shape and this shard's offsets in it; all "" for a tensor that is not sharded. Since 8.
    ("mesh_shape", "str"),
    ("placements", "str"),
    ("global_shape", "str"),
    ("offsets", "str"),
)
STAT_COLUMNS = tuple(name for name, _ in INDEX_COLUMNS if name.startswith("stat_"))
SKETCH_COLUMNS = tuple(name for name, _ in INDEX_COLUMNS if name.startswith("sketch_"))
# the version that added a column (absent: version 1); older indexes lack it
COLUMN_SINCE = {**{name: 2 if k < 8 else 12 for k, name in enumerate(SKETCH_COLUMNS)},
                "checksum": 4, "micro_batch": 5, "injected": 6, "digest": 7, "mesh_shape": 8,
                "placements": 8, "global_shape": 8, "offsets": 8, "addends": 10, "grad_scale": 11}
SHARDING_COLUMNS = ("mesh_shape", "placements", "global_shape", "offsets")
PLACEMENT_SEPARATOR = ";"  # a placement's own text may hold a comma: _S(0, 2)
NO_CHECKSUM = -1  # `checksum` of a row without a dataset, or of a file older than version 4
NO_DIGEST = -1    # `digest` of a row that has none (above), or of a file older than 7
# `micro_batch` of a parameter gradient (accumulated over the step), or in a file older than 5
NO_MICRO_BATCH = -1
# `grad_scale` of a row whose values carry no loss scale (forward kinds; a parameter's gradient
# taken as an optimizer step began, which GradScaler.step unscaled), or of a file older than 11
NO_GRAD_SCALE = 1.0
INDEX_COLUMN_NAMES = tuple(name for name, _ in INDEX_COLUMNS)


def name_bytes(text: str) -> bytes:
    """How the dumper stores a name or any other text: UTF-8, with a lone surrogate (which
    UTF-8 cannot hold, e.g. from a file name decoded with ``surrogateescape``) written as its
    escape ``\\udcXX``."""
    return text.encode("utf-8", "backslashreplace")


class DataChecksum:
    """The `checksum` of a dataset: the sum ``s``, modulo 2**64, of its stored bytes in C
    order read as little-endian unsigned 64-bit words (the last one padded with zero bytes),
    folded to 53 bits (exact in float64, as pandas may hold it): ``(s mod 2**53) XOR (s div
    2**53)``. Every flipped bit changes it; random damage goes unseen about once in 2**53.
    Memory-bound (~15 times the speed of zlib.crc32), so the writer pays little for it.
    :meth:`update` takes the dataset's bytes in consecutive pieces of any sizes."""

    _LOW = (1 << 53) - 1

    def __init__(self) -> None:
        self._total = 0
        self._carry = b""  # the bytes of an unfinished word

    def update(self, stored: np.ndarray) -> "DataChecksum":
        data = np.ascontiguousarray(stored).reshape(-1).view(np.uint8)
        if self._carry:
            need = 8 - len(self._carry)
            head, data = self._carry + data[:need].tobytes(), data[need:]
            self._carry = b""
            if len(head) < 8:
                self._carry = head
                return self
            self._total += int.from_bytes(head, "little")
        whole = len(data) // 8 * 8
        if whole:
            words = np.frombuffer(data[:whole], dtype="<u8")
            self._total += int(np.add.reduce(words, dtype=np.uint64))
        self._carry = data[whole:].tobytes()
        return self

    @property
    def value(self) -> int:
        return fold_word_sum(self._total + int.from_bytes(self._carry.ljust(8, b"\0"), "little"))


def fold_word_sum(total: int) -> int:
    """A sum of 64-bit words (any int; taken modulo 2**64) as a checksum or digest: folded to 53
    bits, ``(s mod 2**53) XOR (s div 2**53)``."""
    total %= 1 << 64
    return (total & DataChecksum._LOW) ^ (total >> 53)


def data_checksum(stored: np.ndarray) -> int:
    """The `checksum` of a dataset holding ``stored`` (see :class:`DataChecksum`)."""
    return DataChecksum().update(stored).value


# Root attributes of every step file.
ATTR_FORMAT_NAME = "format_name"
ATTR_FORMAT_VERSION = "format_version"
ATTR_INDEX_CRC = "index_crc32"  # zlib.crc32 of the index table's bytes (since version 4; some
# version 2 files have it)
# Why the step is incomplete ("" when it is complete): written when the step ended while an
# exception was propagating or module calls were left open. Since version 4.
ATTR_INCOMPLETE = "incomplete"
# "" or, for a localizing re-run (dumper.injection), the reference dump whose values were
# injected and the kinds injected: "dumps/a (input, param, grad_output)". Since version 6.
ATTR_INJECTED_FROM = "injected_from"


def injected_from(reference: str, kinds: Iterable[str]) -> str:
    """The ``injected_from`` text of a re-run on ``reference``'s values of ``kinds``."""
    return f"{reference} ({', '.join(kinds)})"


def parse_injected_from(text: str) -> tuple[str, tuple[str, ...]]:
    """The reference path and the kinds of an ``injected_from`` text (("", ()) for "")."""
    reference, _, kinds = text.rpartition(" (")
    if not text or not kinds.endswith(")"):
        return text, ()
    return reference, tuple(k for k in kinds[:-1].split(", ") if k)


# The paths of the modules that ran as compiled code (regional compilation, ``module.compile()``,
# or a whole model in a ``torch.compile`` wrapper), one per line, outermost only ("" for none;
# the root is "<root>"): recorded at their boundaries, the modules inside them are not
# recorded. Since version 7.
ATTR_COMPILED = "compiled"
ROOT_NAME = "<root>"
# What a dump stores per tensor: its values; statistics; a digest of its bits (since version 7).
MODE_TENSORS, MODE_STATS, MODE_HASH = "tensors", "stats", "hash"
MODES = (MODE_TENSORS, MODE_STATS, MODE_HASH)
RUN_ATTR_TYPES: dict[str, type] = {
    "mode": str, "epoch": int, "step": int, "rank": int, "world_size": int,
    "torch_version": str, "device": str, "default_dtype": str, "tf32_matmul": bool,
    "tf32_cudnn": bool, "float32_matmul_precision": str, "deterministic_algorithms": bool,
    "cudnn_deterministic": bool, "created": str, ATTR_INJECTED_FROM: str, ATTR_COMPILED: str,
}
RUN_ATTRS = tuple(RUN_ATTR_TYPES)
# the type of every root attribute a reader relies on
ATTR_TYPES: dict[str, type] = {**RUN_ATTR_TYPES, ATTR_FORMAT_NAME: str, ATTR_FORMAT_VERSION: int,
                               ATTR_INDEX_CRC: int, ATTR_INCOMPLETE: str}
# root attributes a reader requires, by the format version since which they are written
REQUIRED_ATTRS_SINCE = {"epoch": 1, "step": 1, "rank": 1, ATTR_INDEX_CRC: 4, ATTR_INCOMPLETE: 4,
                        ATTR_INJECTED_FROM: 6, ATTR_COMPILED: 7}


def compiled_modules(attrs: dict) -> list[str]:
    """The module paths of a step's ``compiled`` attribute (the root as "")."""
    names = [n for n in str(attrs.get(ATTR_COMPILED, "")).split("\n") if n]
    return ["" if n == ROOT_NAME else n for n in names]

# Root attributes that decide which kernels a step ran. Two steps that agree on them (the device
# by type), on the CPU or with deterministic algorithms on both sides, compute tensors of equal
# dtypes bit-identically from equal inputs. The world size is one of them: collectives (a
# data-parallel all-reduce of gradients, FSDP's reduce-scatter) add up in another order, and
# sharded parameters are computed on as views of other buffers, over another number of ranks.
# The TF32 flags only choose CUDA kernels (a CPU run's cuDNN flag is torch's default or not).
KERNEL_ATTRS = ("torch_version", "device", "tf32_matmul", "tf32_cudnn", "float32_matmul_precision",
                "world_size")
CUDA_ONLY_ATTRS = ("tf32_matmul", "tf32_cudnn")


def same_kernels(attrs_a: dict, attrs_b: dict) -> bool:
    """Whether two steps (their root attributes) compute bit-identically (see KERNEL_ATTRS)."""
    def kernels(attrs):
        device = str(attrs.get("device", "")).split(":")[0]
        return [device if k == "device" else None if k in CUDA_ONLY_ATTRS and device != "cuda"
                else attrs.get(k) for k in KERNEL_ATTRS]
    deterministic = all(str(a.get("device", "")).startswith("cpu")
                        or a.get("deterministic_algorithms") for a in (attrs_a, attrs_b))
    return deterministic and kernels(attrs_a) == kernels(attrs_b)


def tf32_allowed(attrs: dict) -> tuple[bool, bool]:
    """Whether a step ran on CUDA with float32 (matmuls, convolutions and cuDNN RNNs) allowed to
    use TF32 (10-bit mantissas): those are then that precise only."""
    cuda = str(attrs.get("device", "")).startswith("cuda")
    matmul = bool(attrs.get("tf32_matmul")) or attrs.get("float32_matmul_precision",
                                                         "highest") != "highest"
    return cuda and matmul, cuda and bool(attrs.get("tf32_cudnn"))


ADDEND_INPUT_MARK = "i"  # an addend that is a call's input: a partial sum that call consumed


def addends_text(terms: Iterable[tuple[str, int, int]]) -> str:
    """The ``addends`` column: per ``(kind, call, index)`` term, ``call:index`` for an
    ``OUTPUT`` of a call, ``i{call}:{index}`` for an ``INPUT`` (ADDEND_INPUT_MARK),
    comma-separated."""
    return ",".join(f"{ADDEND_INPUT_MARK if kind == INPUT else ''}{call}:{index}"
                    for kind, call, index in terms)


_ADDEND = r"i?\d{1,9}:\d{1,9}"  # int32 numbers
_ADDENDS_RE = re.compile(rf"(?:{_ADDEND}(?:,{_ADDEND})*)?")


def parse_addends(text: str) -> list[tuple[str, int, int]]:
    """The ``(kind, call, index)`` terms of an ``addends`` text (:func:`addends_text`);
    ValueError for a text that is not one."""
    if not _ADDENDS_RE.fullmatch(text):
        raise ValueError(f"not call:index pairs: {text!r}")
    terms = []
    for part in filter(None, text.split(",")):
        kind = INPUT if part.startswith(ADDEND_INPUT_MARK) else OUTPUT
        call, index = part.lstrip(ADDEND_INPUT_MARK).split(":")
        terms.append((kind, int(call), int(index)))
    return terms


def format_shape(shape: tuple[int, ...]) -> str:
    return ",".join(str(s) for s in shape)


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",")) if text else ()


def format_placements(placements: tuple[str, ...]) -> str:
    return PLACEMENT_SEPARATOR.join(placements)


def parse_placements(text: str) -> tuple[str, ...]:
    return tuple(text.split(PLACEMENT_SEPARATOR)) if text else ()
