"""How a long-running process (node, coordinator) gets its settings, in one place and by a library.

Each setting has one default, stated on its settings class. A value can come, from weakest to
strongest, from that default, the `[node]` / `[coordinator]` table of a TOML file (`--config FILE`),
the environment (`LAYERSWARM_NODE_PORT=50051`; lists as JSON: `LAYERSWARM_COORDINATOR_PEERS='["a:1"]'`)
and the command line. pydantic-settings reads the file and the environment and validates the result;
a bad value raises `pydantic.ValidationError` naming the setting.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar

from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from typing_extensions import Self

from .security import SecuritySettings

# What a --config file that is not TOML raises: pydantic-settings reads it with tomllib, or before Python
# 3.11 (the Jetson images run 3.10) with tomli, whose error is another class.
if sys.version_info >= (3, 11):
    from tomllib import TOMLDecodeError
else:
    from tomli import TOMLDecodeError

__all__ = ["SECURITY_FILES", "ProcessSettings", "TOMLDecodeError", "security_from_files"]

SECURITY_FILES = ("token_file", "tls_cert", "tls_key", "tls_ca", "tls_relay_cert", "tls_relay_key")  # from_files' order


class ProcessSettings(BaseSettings):
    """Frozen, validated settings of one process; unknown keys are errors, not silently ignored."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)
    section: ClassVar[str]  # the TOML table and the environment prefix: LAYERSWARM_<SECTION>_

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings)  # the config file enters through load(), below the environment

    @classmethod
    def load(cls, config_file: Path | None = None, **command_line: Any) -> Self:
        """Defaults < `config_file`'s [section] table < LAYERSWARM_<SECTION>_* < `command_line`."""
        values: dict[str, Any] = {}
        if config_file is not None:
            values.update(TomlConfigSettingsSource(cls, toml_file=config_file, toml_table_header=(cls.section,))())
        values.update(EnvSettingsSource(cls)())
        values.update(command_line)
        return cls(**values)

    @classmethod
    def env_name(cls, field: str) -> str:
        return f"{cls.model_config.get('env_prefix', '')}{field}".upper()


def security_from_files(data: Any) -> Any:
    """A model validator's helper: turn the token and TLS file settings into loaded `security`."""
    if not isinstance(data, dict) or "security" in data or not any(data.get(k) for k in SECURITY_FILES):
        return data
    paths = [Path(data[k]) if data.get(k) else None for k in SECURITY_FILES]
    return {**data, "security": SecuritySettings.from_files(*paths)}
