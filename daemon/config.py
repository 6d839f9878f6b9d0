"""One typed configuration, built once at the edge and passed down.

An option ``foo_bar`` is ``--foo-bar`` on the command line, ``STRATA_FOO_BAR`` in the
environment and ``foo_bar`` in ``$XDG_CONFIG_HOME/strata/config.toml``; that is also the order of
precedence over the defaults. Each layer is read into plain values that remember where they came
from, so that an error names the option in the spelling the user typed, and ``strata config show``
can say where each effective value came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from strata.daemon.config_checks import as_list, device_name, list_text, loopback
from strata.engine.options import ARENA_GRANULE_MIB, BOUNDS, DEFAULTS

ENV_PREFIX = "STRATA_"
# Prefixed variables that are not options: the loading's own; the engine's decode cuts' knob
ENV_RESERVED = frozenset({"STRATA_CONFIG", "STRATA_DECODE_TUNE", "STRATA_PDL"})

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
KvCacheType = Literal["f16", "f32"]
MiB = Annotated[int, Field(ge=0)]


class ConfigError(Exception):
    """A configuration that cannot be used; ``str()`` is the one line shown to the user."""


class Origin(StrEnum):
    DEFAULT = "default"
    FILE = "file"
    ENV = "environment"
    FLAG = "command line"


@dataclass(frozen=True)
class Setting:
    """A raw value and where it came from: ``spelling`` is the name the user wrote."""

    value: object
    origin: Origin
    spelling: str


# The options the engine takes by another name here (the rest have the engine's names); the
# daemon's reserve_mib is the run-time reserve only
ENGINE_NAMES = {"elastic_reserve_mib": "reserve_mib"}


def _engine(name: str, description: str, *, default: Any = None, **extra: Any) -> Any:
    """A field of an engine option: its default and bounds are ``engine/options.py``'s (so that
    ``EngineOptions()`` and ``StrataConfig()`` agree); ``default`` and ``extra`` only where the
    configuration differs on purpose (``device``'s ``auto``, resolved at the edge)."""
    option = ENGINE_NAMES.get(name, name)
    bound = BOUNDS.get(option)
    if bound is not None:
        extra.setdefault("ge", bound.low)
        if bound.high is not None:
            extra.setdefault("le", bound.high)
    value = DEFAULTS[option] if default is None else default
    return Field(value, description=description, **extra)


class StrataConfig(BaseSettings):
    """Every option of Strata. Field docs are the option's help text."""

    # Sources are assembled by :func:`load_config` (which tracks where each value came from),
    # so the model validates an already merged mapping and reads nothing by itself.
    model_config = SettingsConfigDict(extra="forbid", validate_default=True, frozen=True)

    model: Path | None = Field(
        None,
        description="GGUF model to serve: a file (a split model's first or any part) or a "
        "model library name (strata models); unset: the built-in demo model",
    )
    models_dir: Path | None = Field(
        None,
        description="folder of the model library, where strata pull puts models "
        "(unset: $XDG_DATA_HOME/strata/models)",
    )
    host: str = Field("127.0.0.1", description="address the HTTP endpoint binds")
    port: int = Field(
        8427, ge=0, le=65535, description="TCP port of the HTTP endpoint (0: any free port)"
    )
    log_level: LogLevel = Field("info", description="logging threshold")
    threads: int | None = _engine("threads", "CPU threads for compute (unset: physical cores - 1)")
    context_length: int | None = _engine(
        "context_length",
        "context window in tokens (unset: the model's; its K/V grows with the "
        "conversations, so a long context costs only what is used)",
    )
    kv_keep_conversations: int = _engine(
        "kv_keep_conversations",
        "conversations whose K/V is kept after their request, so a later request "
        "that extends one of them computes only its new tokens (they count in the VRAM budget "
        "and are the first to go when it is short; 0: only the last request's)",
    )
    kv_fixed: bool = _engine(
        "kv_fixed",
        "map the K/V for the whole context at load and never give it back (the "
        "growing K/V's control, for measurements)",
    )
    prefill_chunk_tokens: int = _engine(
        "prefill_chunk_tokens", "prompt tokens computed per prefill chunk (a safe point)"
    )
    kv_cache_type: KvCacheType = _engine("kv_cache_type", "element type of the K/V cache")
    device: str = _engine(
        "device",
        "compute device: auto (cuda when present), cpu, cuda or cuda:N",
        default="auto",  # the engine takes the device this resolves to (engine_setup)
    )
    devices: list[str] | None = _engine(
        "devices",
        "compute devices of a layer split, one stage each, in layer order "
        "(comma-separated: cuda:0,cuda:1; unset: one stage on device)",
    )
    layer_split: list[int] | None = _engine(
        "layer_split",
        "layers per device of devices, in order (comma-separated: 20,28; each >= 1, "
        "their sum the model's layers; unset: by each device's free memory)",
    )
    cache_mib: int | None = _engine(
        "cache_mib",
        "expert cache budget in MiB (unset: free VRAM minus elastic_reserve_mib on a "
        "GPU, 0 on the CPU)",
    )
    elastic_tail_mib: int | None = _engine(
        "elastic_tail_mib",
        "elastic part of the cache in MiB (unset: three quarters of it; the core, "
        "never lent, is the rest)",
    )
    elastic_reserve_mib: int = _engine(
        "elastic_reserve_mib",
        "VRAM in MiB kept free for other programs (a program's first allocation must fit in it)",
    )
    host_budget_mib: int | None = _engine(
        "host_budget_mib",
        "RAM in MiB for the host tier, the experts no VRAM slot holds (unset: "
        "MemAvailable at load minus max(4 GiB, RAM/8); 0: read them from the file)",
    )
    adapt_swaps: int = _engine(
        "adapt_swaps",
        "most exchanges of a hot expert in RAM with a cold one in VRAM at each "
        "adaptation point (every 64 decode steps; 0: never)",
    )
    prefetch_experts: int = _engine(
        "prefetch_experts",
        "GPU decode: of each layer's experts predicted a layer early, copy up to "
        "this many that are in RAM into VRAM ahead of its routing (0: never, the default; at "
        "most the model's experts per layer)",
    )
    cpu_share: float | None = _engine(
        "cpu_share",
        "GPU decode: the share (0 to 1) of each layer's chosen experts in RAM that "
        "the CPU computes, on `threads` threads, while the GPU reads the others over PCIe (0: "
        "none, the GPU reads them all; unset: chosen at load by timing a few decode steps at "
        "0, 0.25, 0.375, 0.5, 0.625 and 0.75, on a GPU with experts in RAM, else 0)",
    )
    verify_experts: bool = _engine(
        "verify_experts",
        "checksum every expert at load and check it after every fill and move "
        "between VRAM and RAM, and on samples at use (costs a wait per resize)",
    )
    arena_chunk_mib: int = _engine(
        "arena_chunk_mib",
        "arena mapping granularity in MiB (a multiple of 2)",
        ge=ARENA_GRANULE_MIB,  # a GPU arena's granule (the engine's CPU arena takes 1 MiB too)
    )
    fast_decode: bool = _engine(
        "fast_decode", "decode on a GPU with the fused Triton kernels (off: reference path)"
    )
    enforce_eager: bool = _engine(
        "enforce_eager", "run the GPU decode kernels without capturing a CUDA graph"
    )
    fast_prefill: bool = _engine(
        "fast_prefill",
        "run prompt chunks on a GPU as tensor-core matrix products (off: reference "
        "path; needs fast_decode)",
    )
    vram_monitor: Literal["auto", "nvml", "simulated", "none"] = Field(
        "auto", description="how free VRAM is watched: auto (nvml on a GPU, else none)"
    )
    simulated_vram_file: Path | None = Field(
        None, description="JSON file describing the simulated device (vram_monitor = simulated)"
    )
    simulated_vram_files: list[Path] | None = Field(
        None,
        description="one simulated device file per device of devices, in order (comma-separated; "
        "vram_monitor = simulated with devices)",
    )
    elastic_stable_ms: int = Field(
        5000, ge=0, le=3_600_000, description="how long free room must last before growing"
    )
    elastic_shrink_step_mib: int = Field(
        1024, ge=1, description="most MiB one periodic check gives back to a growing program"
    )
    elastic_period_ms: int = Field(
        1000, ge=10, le=60_000, description="interval of the VRAM checks in milliseconds"
    )
    vram_max_mib: int | None = Field(
        None, ge=1, description="most VRAM Strata uses in MiB, whatever is free (unset: no cap)"
    )
    idle_release_s: int = Field(
        300,
        ge=0,
        le=86_400,
        description="after this many seconds without a request the cache shrinks to its core "
        "and grows back with the next request (0: never)",
    )
    gamemode_reserve_mib: int | None = Field(
        None, ge=1, description="VRAM kept free while Feral GameMode reports a game (unset: off)"
    )
    max_queued_requests: int = Field(
        16, ge=0, le=4096, description="generations that may wait behind the running one"
    )
    api_key: str | None = Field(
        None, description="bearer token the HTTP API requires (unset: none; bind stays local)"
    )
    cors_allow_origins: str | None = Field(
        None, description="comma-separated origins allowed by CORS (unset: CORS closed)"
    )
    allowed_hosts: str | None = Field(
        None,
        description="comma-separated extra names a request's Host header may give (beside "
        "127.0.0.1, localhost, [::1] and host)",
    )
    allow_remote_without_key: bool = Field(
        False,
        description="serve a non-loopback host without api_key (anyone who reaches it can "
        "use the model)",
    )
    max_stop_sequences: int = Field(
        4, ge=1, le=64, description="most stop strings one request may give (OpenAI's limit: 4)"
    )
    model_alias: list[str] | None = Field(
        None,
        description="other names that select the model over HTTP, listed by /v1/models "
        "(comma-separated)",
    )
    serve_any_model_name: bool = Field(
        True,
        description="a request naming another model is served by the loaded one (as "
        "llama-server does); false: a 404 naming the models served",
    )
    reasoning_format: Literal["auto", "deepseek", "deepseek-legacy", "none"] = Field(
        "auto",
        description="how a reply's thought is returned when the request does not say: "
        "auto/deepseek (reasoning_content), deepseek-legacy (both), none (left in content)",
    )
    enable_thinking: bool = Field(
        True,
        description="whether a chat template that can switch thinking off thinks when the "
        "request does not say",
    )
    max_request_kib: int = Field(
        1024, ge=1, le=1_048_576, description="largest HTTP request body in KiB"
    )
    borrow_timeout_ms: int = Field(
        10_000,
        ge=1,
        le=24_000,
        description="how long a reserve or Borrow waits for its room (below D-Bus's 25 s)",
    )

    # -- bounded memory (issue 16): what requests in progress may hold at once --------------------
    max_requests_in_progress: int = Field(
        64,
        ge=1,
        le=65_536,
        description="HTTP requests served at once (beyond: 503); with max_request_kib it bounds "
        "the request bodies held",
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_coercion(cls, value: Any, info: Any) -> Any:
        # TOML's `port = true` must not become port 1: a bool is only a bool.
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation is not bool:
            raise ValueError("expected a number or a string, not a boolean")
        return value

    @field_validator("log_level", "kv_cache_type", mode="before")
    @classmethod
    def _lowercase(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("model", "models_dir", "simulated_vram_file", mode="before")
    @classmethod
    def _non_empty_path(cls, value: Any) -> Any:
        # "" would become Path("."): the current directory, never what was meant
        if isinstance(value, str) and not value.strip():
            raise ValueError("expected a file path, not an empty string (unset it instead)")
        return value

    @field_validator("model", "models_dir", mode="after")
    @classmethod
    def _expand_user(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        name = device_name(value)
        if name is None:
            raise ValueError("expected auto, cpu, cuda or cuda:N")
        return name

    @field_validator("devices", mode="before")
    @classmethod
    def _device_list(cls, value: Any) -> Any:
        names = as_list(value)
        if names is None:
            return value
        if not names:
            raise ValueError("expected at least one device (unset it for one device)")
        out = []
        for name in names:
            if not isinstance(name, str):
                raise ValueError(f"expected device names, got {name!r}")
            device = device_name(name)
            if device is None or device == "auto":
                raise ValueError(f"{name!r} is not a device: expected cpu, cuda or cuda:N")
            out.append(device)
        return out

    @field_validator("layer_split", mode="before")
    @classmethod
    def _layer_counts(cls, value: Any) -> Any:
        items = as_list(value)
        if items is None:
            return value
        if not items:
            raise ValueError("expected one layer count per device (unset it for automatic)")
        counts = []
        for item in items:
            if isinstance(item, str) and item.strip().isdigit():
                item = int(item.strip())
            # a bool is not a count, and 2.0 or "2.5" would pass as a whole number, silently
            if not isinstance(item, int) or isinstance(item, bool) or item < 1:
                raise ValueError(f"expected whole numbers of layers >= 1, got {item!r}")
            counts.append(item)
        return counts

    @field_validator("model_alias", mode="before")
    @classmethod
    def _alias_list(cls, value: Any) -> Any:
        items = as_list(value)
        if items is None:
            return value
        for item in items:
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"expected model names, got {item!r} (no empty name)")
        return [item.strip() for item in items] or None

    @field_validator("simulated_vram_files", mode="before")
    @classmethod
    def _file_list(cls, value: Any) -> Any:
        items = as_list(value)
        if items is None:
            return value
        if not items:
            raise ValueError("expected one file per device (unset it instead)")
        for item in items:
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"expected file paths, got {item!r}")
        return [Path(item.strip()).expanduser() for item in items]

    @model_validator(mode="after")
    def _split_needs_devices(self) -> StrataConfig:
        if self.devices is None:
            if self.layer_split is not None:
                raise ValueError(
                    f"layer_split {list_text(self.layer_split)} needs devices (one count per "
                    "device); set devices too, or unset layer_split"
                )
            return self
        if self.device != "auto":
            raise ValueError(
                f"device {self.device!r} and devices {list_text(self.devices)} are both set: "
                "with devices, each stage's device comes from it (unset device)"
            )
        if self.layer_split is not None and len(self.layer_split) != len(self.devices):
            raise ValueError(
                f"layer_split {list_text(self.layer_split)} has {len(self.layer_split)} "
                f"count(s) for the {len(self.devices)} device(s) of devices "
                f"{list_text(self.devices)}: expected one per device"
            )
        return self

    @model_validator(mode="after")
    def _one_file_perdevice_name(self) -> StrataConfig:
        files = self.simulated_vram_files
        if files is None:
            return self
        if self.simulated_vram_file is not None:
            raise ValueError(
                "simulated_vram_file and simulated_vram_files are both set: use one (the list "
                "for devices)"
            )
        count = len(self.devices) if self.devices is not None else 1
        if len(files) != count:
            raise ValueError(
                f"simulated_vram_files {list_text([str(f) for f in files])} has {len(files)} "
                f"file(s) for {count} device(s): expected one per device"
            )
        return self

    @field_validator("arena_chunk_mib")
    @classmethod
    def _even_chunk(cls, value: int) -> int:
        if value % ARENA_GRANULE_MIB:
            raise ValueError(
                f"expected a multiple of {ARENA_GRANULE_MIB} (the GPU's mapping granularity)"
            )
        return value

    @field_validator("simulated_vram_file", mode="after")
    @classmethod
    def _expand_sim(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @model_validator(mode="after")
    def _simulated_needs_a_file(self) -> StrataConfig:
        if self.vram_monitor != "simulated" or self.simulated_vram_files is not None:
            return self
        if self.devices is not None and len(self.devices) > 1:
            raise ValueError(
                f"vram_monitor = simulated with {len(self.devices)} devices needs "
                "simulated_vram_files, one file per device"
            )
        if self.simulated_vram_file is None:
            raise ValueError("vram_monitor = simulated needs simulated_vram_file")
        return self

    @property
    def device_count(self) -> int:
        """The stages of the model: one per device of ``devices``, else one."""
        return len(self.devices) if self.devices is not None else 1

    def simulated_files(self) -> list[Path | None]:
        """The simulated device file of each device, in order (None: not simulated)."""
        if self.simulated_vram_files is not None:
            return list(self.simulated_vram_files)
        return [self.simulated_vram_file] * self.device_count

    @field_validator("host")
    @classmethod
    def _non_empty_host(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("expected a host name or address, not an empty string")
        return value

    @field_validator("api_key")
    @classmethod
    def _real_key(cls, value: str | None) -> str | None:
        # an empty key must never mean "no key": that would turn authentication off silently
        if value is not None and not value.strip():
            raise ValueError("expected a key, not an empty or blank string (unset it for none)")
        return value

    @model_validator(mode="after")
    def _remote_needs_a_key(self) -> StrataConfig:
        if self.api_key is None and not self.allow_remote_without_key and not loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is reachable from other machines: set api_key (or "
                "STRATA_API_KEY), or allow_remote_without_key = true to serve it without one"
            )
        return self


OPTION_NAMES: tuple[str, ...] = tuple(StrataConfig.model_fields)


def env_of(name: str) -> str:
    return ENV_PREFIX + name.upper()


# The loading half (the flags, each source's settings, the merge, ``strata config show``) is in
# config_sources, which imports this module; its names stay importable from here, looked up
# when first asked for (so that either module may be imported first).
_SOURCES = frozenset({
    "flag_settings", "env_settings", "file_settings", "LoadedConfig", "load_config",
    "describe_sources", "ENGINE_OPTIONS", "LIBRARY_OPTIONS", "BENCH_OPTIONS", "add_option_flags",
    "SECRET_OPTIONS", "flag_of",
})  # fmt: skip


def __getattr__(name: str) -> object:
    if name in _SOURCES:
        from strata.daemon import config_sources

        return getattr(config_sources, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
