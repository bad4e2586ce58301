"""The node service's configuration: typed dataclasses, loaded from TOML, env and flags.

Precedence: command-line flags override ``NVEC_*`` environment variables, which override
the TOML file, which overrides the defaults below. Every field is validated when the
config is built; a bad one raises :class:`ServiceConfigError` naming the field (e.g.
``hostcache[1].capacity``) and saying what to write instead. See docs/service.md.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch

from hostcache import BadArgumentError, layout
from hostcache.segment import check_name
from nvecache.apps.errors import ServiceConfigError
from nvecache.common import rows

LogFormat = Literal["text", "json"]
Warmup = Literal["none", "all"] | int

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def default_state_dir() -> str:
    """``$XDG_RUNTIME_DIR/nvec`` where that is set, else ``/tmp/nvec-<uid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "nvec") if runtime else f"/tmp/nvec-{os.getuid()}"


# -- field checks ---------------------------------------------------------------------------


def _int(where: str, value: object, lo: int, hi: int = 1 << 62) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ServiceConfigError(where, f"must be an integer in {lo}..{hi}; got {value!r}")
    if not lo <= value <= hi:
        raise ServiceConfigError(where, f"must be in {lo}..{hi}; got {value}")
    return value


def _float(where: str, value: object, lo: float, hi: float) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ServiceConfigError(where, f"must be a number of seconds in [{lo}, {hi}]; "
                                 f"got {value!r}")
    if not lo <= float(value) <= hi:
        raise ServiceConfigError(where, f"must be in [{lo}, {hi}]; got {value}")
    return float(value)


def _bool(where: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false",
                                                     "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ServiceConfigError(where, f"must be true or false; got {value!r}")


def _str(where: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ServiceConfigError(where, f"must be a non-empty string; got {value!r}")
    return value


def _name(where: str, value: object) -> str:
    try:
        return check_name(value)
    except BadArgumentError as e:
        raise ServiceConfigError(where, str(e)) from None


def _mode(where: str, value: object) -> int:
    if isinstance(value, str):
        try:
            value = int(value, 8)
        except ValueError:
            raise ServiceConfigError(where, f"must be octal like \"0600\"; got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value & ~0o666 or not (
        value & 0o600 == 0o600
    ):
        raise ServiceConfigError(where, "must be a permission mask within 0666 that lets the "
                                 f"owner read and write (\"0600\", \"0660\"); got {value!r}")
    return value


def _dtype(where: str, value: object, names: tuple[str, ...] = tuple(rows.DTYPES),
           hint: str = "") -> str:
    if not isinstance(value, str) or value not in names:
        raise ServiceConfigError(where, f"must be one of {sorted(names)}; got {value!r}{hint}")
    return value


def _warmup(where: str, value: object) -> Warmup:
    if value in ("none", "all"):
        return "none" if value == "none" else "all"
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return "none" if value == 0 else value
    raise ServiceConfigError(where, f"must be \"none\", \"all\" or a number of rows >= 0; "
                             f"got {value!r}")


def _unknown(where: str, given: Mapping[str, Any], known: set[str]) -> None:
    extra = sorted(set(given) - known)
    if extra:
        raise ServiceConfigError(f"{where}.{extra[0]}" if where else extra[0],
                                 f"unknown field; known fields are {sorted(known)}")


# -- the dataclasses ------------------------------------------------------------------------


@dataclass(frozen=True)
class TableConfig:
    """One shared table the service owns: a host cache or a linear table."""

    #: ``"hostcache"`` (a HostCache) or ``"linear"`` (a SharedMemBlock).
    kind: Literal["hostcache", "linear"]
    #: segment name, ``[A-Za-z0-9_.-]{1,100}``; replicas attach by this name.
    name: str
    #: elements per row.
    dim: int
    #: host cache: rows it holds (rounded up to whole buckets); linear: number of rows.
    capacity: int
    #: a stored dtype name of ``nvecache.common.rows.DTYPES`` (``float32``, ``float16``,
    #: ``bfloat16``, ``float64``); a host cache's may be a quantized format (``int8``,
    #: ``float8_e4m3fn``: its rows stored quantized, read dequantized by the layers).
    dtype: str = "float32"
    #: slots per bucket of a host cache (4, 8, 16 or 32); 0 for a linear table.
    ways: int = 8
    #: permission bits of the segment and its lock file.
    mode: int = 0o600
    #: records in the invalidation ring.
    ring_capacity: int = layout.DEFAULT_RING_CAPACITY
    #: parameter-server URL behind the table (``redis://``, ``file://``, ...); None: none.
    ps_url: str | None = None
    #: the table's name in the parameter server (default: ``name``).
    ps_table: str | None = None
    #: a host cache's parameter-server table's dtype, any stored format (default:
    #: ``dtype``): a quantized host cache in front of a float32 table, say.
    ps_dtype: str | None = None
    #: create the parameter-server table (empty, with this dim and dtype) when it does not
    #: exist; False: a missing one is an error (load it first with ``psclient load``).
    ps_create: bool = False
    #: extra ``psclient.connect`` options, e.g. ``{socket_timeout = 0.5}``.
    ps_options: dict[str, Any] = field(default_factory=dict)
    #: rows pre-loaded at start: ``"none"``, ``"all"`` or the N hottest (see warmup_keys).
    warmup: Warmup = "none"
    #: ``.npy`` (int64 [N]) or text file (one key per line), hottest first. Without it the
    #: keys are ``0..ps.size()-1`` (what ``ps.load`` writes by default).
    warmup_keys: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return rows.torch_dtype(self.dtype)

    @property
    def ps_name(self) -> str:
        return self.ps_table or self.name

    @property
    def ps_format(self) -> str:
        """The parameter-server table's dtype name (``ps_dtype``, default ``dtype``)."""
        return self.ps_dtype or self.dtype

    @property
    def ps_torch_dtype(self) -> torch.dtype:
        return rows.torch_dtype(self.ps_format)

    def geometry(self) -> layout.Geometry:
        """The segment geometry this table asks for (as ``layout.plan`` computes it)."""
        kind = layout.KIND_HOST_CACHE if self.kind == "hostcache" else layout.KIND_LINEAR
        return layout.plan(kind, capacity=self.capacity, dim=self.dim, dtype=self.torch_dtype,
                           ways=self.ways if self.kind == "hostcache" else 0,
                           ring_capacity=self.ring_capacity)


_HC_FIELDS = {"name", "capacity", "dim", "dtype", "ways", "mode", "ring_capacity", "ps_url",
              "ps_table", "ps_dtype", "ps_create", "ps_options", "warmup", "warmup_keys"}
_QUANTIZED_HINT = (" (quantized rows, int8 or float8_e4m3fn, are served in [[hostcache]] "
                   "tables; a [[linear]] table stores a plain dtype)")
_LINEAR_FIELDS = (_HC_FIELDS - {"capacity", "ways", "ps_dtype"}) | {"rows"}


def table_from_dict(kind: str, raw: Mapping[str, Any], where: str) -> TableConfig:
    """Validate one ``[[hostcache]]`` / ``[[linear]]`` entry."""
    if not isinstance(raw, Mapping):
        raise ServiceConfigError(where, f"must be a table of fields; got {raw!r}")
    known = _HC_FIELDS if kind == "hostcache" else _LINEAR_FIELDS
    _unknown(where, raw, known)
    size_field = "capacity" if kind == "hostcache" else "rows"
    for required in ("name", size_field, "dim"):
        if required not in raw:
            raise ServiceConfigError(f"{where}.{required}", "is required")
    name = _name(f"{where}.name", raw["name"])
    where = f"{where} ({name})"
    ps_url = raw.get("ps_url")
    if ps_url is not None and (not isinstance(ps_url, str) or "://" not in ps_url):
        raise ServiceConfigError(f"{where}.ps_url", "must be a URL like redis://host:6379/0 or "
                                 f"file:///path; got {ps_url!r}")
    options = raw.get("ps_options", {})
    if not isinstance(options, Mapping):
        raise ServiceConfigError(f"{where}.ps_options", "must be a table of connect options")
    ps_create = _bool(f"{where}.ps_create", raw.get("ps_create", False))
    if ps_create and ps_url is None:
        raise ServiceConfigError(f"{where}.ps_create", "needs ps_url (the parameter server to "
                                 "create the table in); set ps_url or remove ps_create")
    warmup = _warmup(f"{where}.warmup", raw.get("warmup", "none"))
    if warmup != "none" and ps_url is None:
        raise ServiceConfigError(f"{where}.warmup", "needs ps_url (rows come from the "
                                 "parameter server); set ps_url or warmup = \"none\"")
    keys_file = raw.get("warmup_keys")
    if keys_file is not None and not os.path.isfile(_str(f"{where}.warmup_keys", keys_file)):
        raise ServiceConfigError(f"{where}.warmup_keys", f"no such file: {keys_file!r}")
    ways = _int(f"{where}.ways", raw.get("ways", 8), 4, 32) if kind == "hostcache" else 0
    dtype = (_dtype(f"{where}.dtype", raw.get("dtype", "float32"), rows.FORMATS)
             if kind == "hostcache" else
             _dtype(f"{where}.dtype", raw.get("dtype", "float32"), hint=_QUANTIZED_HINT))
    ps_dtype = raw.get("ps_dtype")
    if ps_dtype is not None:
        if ps_url is None:
            raise ServiceConfigError(f"{where}.ps_dtype", "needs ps_url (the parameter server "
                                     "whose table has it); set ps_url or remove ps_dtype")
        ps_dtype = _dtype(f"{where}.ps_dtype", ps_dtype, rows.FORMATS)
    if kind == "hostcache" and ways not in (4, 8, 16, 32):
        raise ServiceConfigError(f"{where}.ways", f"must be 4, 8, 16 or 32; got {ways}")
    cfg = TableConfig(
        kind="hostcache" if kind == "hostcache" else "linear",
        name=name,
        dim=_int(f"{where}.dim", raw["dim"], 1, 1 << 20),
        capacity=_int(f"{where}.{size_field}", raw[size_field], 1),
        dtype=dtype,
        ways=ways,
        mode=_mode(f"{where}.mode", raw.get("mode", 0o600)),
        ring_capacity=_int(f"{where}.ring_capacity",
                           raw.get("ring_capacity", layout.DEFAULT_RING_CAPACITY), 1, 1 << 30),
        ps_url=ps_url,
        ps_table=None if raw.get("ps_table") is None
        else _name(f"{where}.ps_table", raw["ps_table"]),
        ps_dtype=ps_dtype,
        ps_create=ps_create,
        ps_options=dict(options),
        warmup=warmup,
        warmup_keys=keys_file,
    )
    try:
        cfg.geometry()
    except BadArgumentError as e:
        raise ServiceConfigError(where, str(e)) from None
    return cfg


@dataclass(frozen=True)
class ServiceConfig:
    """Everything ``hostcache serve`` needs to run one node."""

    #: the tables this node serves (host caches and linear tables), names unique.
    tables: tuple[TableConfig, ...]
    #: where the lock file, feed cursors and endpoint file live (one service per dir).
    state_dir: str = field(default_factory=default_state_dir)
    #: address of the metrics / health HTTP server.
    metrics_host: str = "127.0.0.1"
    #: its port; 0 picks a free one (written to ``<state_dir>/endpoint.json``); -1: none.
    metrics_port: int = 9464
    #: seconds between change-feed polls when the feed is idle.
    poll_interval: float = 0.2
    #: seconds between reaps of dead processes' counter slots.
    reap_interval: float = 1.0
    #: seconds after which keys erased by the feed are erased once more (closes the race
    #: with a replica that read the old row from the PS just before the write).
    settle: float = 1.0
    #: keep the segments on a clean shutdown instead of removing them.
    keep: bool = False
    #: at start, compile the per-key loops and (on a CUDA node) the kernels of every layer
    #: type that can read each table into the node's on-disk caches, in a child process,
    #: so that replicas load them instead of compiling on their first lookups
    #: (``nvecache.apps.service.compiled``).
    warm_compiled: bool = True
    #: ``"text"`` or ``"json"`` (one JSON object per log line).
    log_format: LogFormat = "text"
    #: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"

    def table(self, name: str) -> TableConfig:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)


_NODE_FIELDS = {f.name for f in fields(ServiceConfig)} - {"tables"}
#: environment variable -> node field
ENV_VARS = {f"NVEC_{name.upper()}": name for name in sorted(_NODE_FIELDS)}


def _node_fields(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        w = f"{where}{key}"
        if key == "state_dir":
            out[key] = _str(w, value)
        elif key == "metrics_host":
            out[key] = _str(w, value)
        elif key == "metrics_port":
            out[key] = _int(w, value, -1, 65535)
        elif key == "poll_interval":
            out[key] = _float(w, value, 0.001, 60.0)
        elif key == "reap_interval":
            out[key] = _float(w, value, 0.01, 3600.0)
        elif key == "settle":
            out[key] = _float(w, value, 0.0, 600.0)
        elif key in ("keep", "warm_compiled"):
            out[key] = _bool(w, value)
        elif key == "log_format":
            if value not in ("text", "json"):
                raise ServiceConfigError(w, f"must be \"text\" or \"json\"; got {value!r}")
            out[key] = value
        elif key == "log_level":
            if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
                raise ServiceConfigError(w, f"must be one of {LOG_LEVELS}; got {value!r}")
            out[key] = value.upper()
        else:
            raise ServiceConfigError(w, f"unknown field; known fields are "
                                     f"{sorted(_NODE_FIELDS | {'hostcache', 'linear'})}")
    return out


def parse_table_spec(spec: str, where: str) -> dict[str, Any]:
    """``"name=ctr,capacity=1000,dim=16,ps_url=redis://h:6379/0"`` -> a field dict."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ServiceConfigError(where, f"expected comma-separated key=value pairs; got "
                                     f"{part!r} in {spec!r}")
        out[key.strip()] = value.strip()
    return out


def _merge_tables(base: list[tuple[str, dict[str, Any], str]],
                  extra: list[tuple[str, dict[str, Any], str]]) -> list[tuple[str, dict, str]]:
    """Entries of ``extra`` override same-named ones of ``base`` field by field."""
    merged = list(base)
    for kind, raw, where in extra:
        for i, (k, old, _) in enumerate(merged):
            if k == kind and old.get("name") == raw.get("name"):
                merged[i] = (kind, {**old, **raw}, where)
                break
        else:
            merged.append((kind, raw, where))
    return merged


def build_config(
    file: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    table_specs: list[str] = (),  # type: ignore[assignment]
    linear_specs: list[str] = (),  # type: ignore[assignment]
) -> ServiceConfig:
    """Build and validate the node config: file < ``NVEC_*`` env < flags.

    Args:
        file: a TOML file (``NVEC_CONFIG`` names one when None).
        env: the environment (default ``os.environ``).
        overrides: node fields given as flags (None values are ignored).
        table_specs, linear_specs: ``--hostcache`` / ``--linear`` specs given as flags.

    Raises:
        ServiceConfigError: a field is bad, unknown or missing (the error names it).
    """
    env = os.environ if env is None else env
    if file is None:
        file = env.get("NVEC_CONFIG") or None
    raw: dict[str, Any] = {}
    if file is not None:
        try:
            with open(file, "rb") as f:
                raw = tomllib.load(f)
        except OSError as e:
            raise ServiceConfigError("--config", f"cannot read {file}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ServiceConfigError("--config", f"{file} is not valid TOML: {e}") from None
    node = _node_fields({k: v for k, v in raw.items() if k not in ("hostcache", "linear")}, "")
    node.update(_node_fields({name: env[var] for var, name in ENV_VARS.items() if var in env},
                             "env "))
    node.update(_node_fields({k: v for k, v in (overrides or {}).items() if v is not None},
                             "--"))
    entries: list[tuple[str, dict[str, Any], str]] = []
    for kind in ("hostcache", "linear"):
        items = raw.get(kind, [])
        if not isinstance(items, list):
            raise ServiceConfigError(kind, f"must be an array of tables ([[{kind}]])")
        entries += [(kind, dict(t) if isinstance(t, Mapping) else t, f"{kind}[{i}]")
                    for i, t in enumerate(items)]
    for var, kind in (("NVEC_HOSTCACHE", "hostcache"), ("NVEC_LINEAR", "linear")):
        specs = [s for s in env.get(var, "").split(";") if s.strip()]
        entries = _merge_tables(entries, [(kind, parse_table_spec(s, f"env {var}"),
                                           f"env {var}[{i}]") for i, s in enumerate(specs)])
    flag_entries = [("hostcache", parse_table_spec(s, "--hostcache"), f"--hostcache[{i}]")
                    for i, s in enumerate(table_specs)]
    flag_entries += [("linear", parse_table_spec(s, "--linear"), f"--linear[{i}]")
                     for i, s in enumerate(linear_specs)]
    entries = _merge_tables(entries, flag_entries)
    tables = tuple(table_from_dict(kind, t, where) for kind, t, where in entries)
    if not tables:
        raise ServiceConfigError("hostcache", "no tables configured: add [[hostcache]] or "
                                 "[[linear]] entries to the config (or --hostcache SPEC)")
    seen: set[str] = set()
    for (_, _, where), t in zip(entries, tables, strict=True):
        if t.name in seen:
            raise ServiceConfigError(f"{where}.name", f"table name {t.name!r} appears twice; "
                                     "every table of a node needs its own name")
        seen.add(t.name)
    return ServiceConfig(tables=tables, **node)


def with_overrides(cfg: ServiceConfig, **changes: Any) -> ServiceConfig:
    """A copy of ``cfg`` with node fields changed (validated like flags)."""
    return replace(cfg, **_node_fields(changes, "--"))
