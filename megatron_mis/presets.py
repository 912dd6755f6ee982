"""Where the shipped YAML files live: ``configs/mis.yaml`` and ``configs/presets/*.yaml``.

In a source checkout (or an editable install) they are read from the repository's ``configs/``;
a wheel installs the same folder as ``megatron_mis/_configs``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["configs_dir", "preset_names", "preset_path"]


def configs_dir() -> Path:
    """The folder holding ``mis.yaml`` and ``presets/``."""
    repo = Path(__file__).resolve().parent.parent / "configs"
    if (repo / "presets").is_dir():
        return repo
    installed = Path(__file__).resolve().parent / "_configs"
    if (installed / "presets").is_dir():
        return installed
    raise FileNotFoundError(
        f"megatron-mis configs not found (looked in {str(repo)!r} and {str(installed)!r}); "
        "reinstall the package"
    )


def preset_names() -> list[str]:
    """Names of the shipped presets (file stems), sorted."""
    return sorted(p.stem for p in (configs_dir() / "presets").glob("*.yaml"))


def preset_path(name: str) -> Path:
    """Path of preset ``name`` (a stem like ``token_tis``), or of a YAML file given by path."""
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
        return candidate
    path = configs_dir() / "presets" / f"{name}.yaml"
    if not path.is_file():
        from megatron_mis.registry import suggest

        names = preset_names()
        raise FileNotFoundError(
            f"unknown preset {name!r}{suggest(name, names)}; shipped presets: {', '.join(names)}"
        )
    return path
