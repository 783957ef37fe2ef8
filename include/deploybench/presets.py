"""Presets: named kinds of run, as data files like the engine profiles.

Named sets of flat form values (deploybench.params), data files like the engine profiles:
``include/presets/<name>.toml`` (shipped: quick, capacity, soak, runbook) and the operator's own in
the folders named by ``$DEPLOYBENCH_PRESETS``::

    description = "A short sustained check: does it serve, and meet the SLO, at the typed rate?"
    [params]
    load_duration_s = 10

A file's keys are checked when it is read (unknown keys and names refused, naming the file and the
key; the values checked as a conf over the defaults). The form's ``preset`` field picks one; the run's
config is the preset's values overlaid by what the person changed. Airflow's form sends every field's
value, defaults included, so "changed" is decided by value: **a preset value applies to a field that
is missing or at its form default; a field holding any other value keeps it** (``apply_preset``).
The consequence: a field cannot be held at its default against a preset that sets it (choose no
preset, or another one). ``configure`` returns what the preset set and what it left, for the validate
log and run.json.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deploybench import params as form
from deploybench import paths
from deploybench.errors import ConfigError

log = logging.getLogger(__name__)

PRESET_DIR = paths.PROJECT_ROOT / "include" / "presets"
PRESET_ENV = "DEPLOYBENCH_PRESETS"
PRESET_NAME = r"^[a-z0-9][a-z0-9_-]{0,63}$"
_PRESET_FILE_KEYS = ("description", "params")


class _PresetFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    description: str = Field(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")
    params: dict[str, Any] = Field(min_length=1)


@dataclass(frozen=True)
class Preset:
    """A named set of flat form values, from ``source`` (a file)."""

    name: str
    description: str
    values: dict[str, Any]
    source: str


@dataclass(frozen=True)
class PresetUse:
    """What a preset did to one conf: the values it ``set`` (fields missing or at their defaults), and the fields
    it names that the conf had changed, which ``kept`` the conf's value."""

    name: str
    source: str
    set: dict[str, Any]
    kept: dict[str, Any]

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "set": dict(self.set), "kept": dict(self.kept)}

    def describe(self) -> str:
        said = f"preset {self.name!r} set " + (", ".join(f"{k}={_show(v)}" for k, v in self.set.items()) or "nothing")
        if self.kept:
            said += "; kept the typed " + ", ".join(f"{k}={_show(v)}" for k, v in self.kept.items())
        return said


def _show(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))[:200]


def preset_dirs() -> list[Path]:
    """The shipped presets, then the folders of $DEPLOYBENCH_PRESETS (os.pathsep-separated)."""
    extra = [Path(p) for p in os.environ.get(PRESET_ENV, "").split(os.pathsep) if p.strip()]
    return [PRESET_DIR, *extra]


def load_preset_file(path: str | Path) -> Preset:
    """One preset file, validated; ConfigError names the file, the key and what is allowed. Its values are
    checked as a conf of their own over the defaults (a preset must make a valid run by itself)."""
    path = Path(path)
    if not re.fullmatch(PRESET_NAME, path.stem) or path.suffix != ".toml":
        raise ConfigError(f"preset {path}: a preset file is <name>.toml, the name in lower-case letters, digits, "
                          "'_' and '-'")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"preset {path}: cannot read it as TOML: {exc}") from exc
    unknown = sorted(set(data) - set(_PRESET_FILE_KEYS))
    if unknown:
        raise ConfigError(f"preset {path}: unknown key(s) {unknown}; a preset file has {', '.join(_PRESET_FILE_KEYS)}")
    try:
        pf = _PresetFile.model_validate(data)
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"preset {path}: {msgs}") from None
    bad = sorted(set(pf.params) - set(form.BY_NAME))
    if bad:
        raise ConfigError(f"preset {path}: unknown parameter(s) {bad} in [params]; a preset sets the trigger "
                          f"form's fields: {', '.join(form.BY_NAME)}")
    try:
        form.without_preset(pf.params)
    except ConfigError as exc:
        raise ConfigError(f"preset {path}: {exc}") from None
    return Preset(path.stem, pf.description, dict(pf.params), str(path))


def _preset_files() -> list[Path]:
    out = []
    for folder in preset_dirs():
        if not folder.is_dir():
            raise ConfigError(f"${PRESET_ENV} names {str(folder)!r}, which is not a folder; fix or unset it")
        out += sorted(folder.glob("*.toml"))
    return out


def presets() -> dict[str, Preset]:
    """Every preset by name, read now (a file added is seen at once); any bad file, or one name in two
    folders, is refused."""
    out: dict[str, Preset] = {}
    for path in _preset_files():
        p = load_preset_file(path)
        if p.name in out:
            raise ConfigError(f"preset {p.name!r} is defined twice: {out[p.name].source} and {path}; rename one")
        out[p.name] = p
    return out


def form_presets() -> dict[str, Preset]:
    """The presets the trigger form offers (read when the DAG file is parsed): every good one; a bad file is
    logged and left out, so that one broken preset does not break the run DAG (a run naming it fails at
    validate with the same error)."""
    try:
        files = _preset_files()
    except ConfigError as exc:
        log.error("presets: %s", exc)
        files = [f for d in preset_dirs() if d.is_dir() for f in sorted(d.glob("*.toml"))]
    out: dict[str, Preset] = {}
    for path in files:
        try:
            p = load_preset_file(path)
        except ConfigError as exc:
            log.error("preset left out of the trigger form: %s", exc)
            continue
        if p.name in out:
            log.error("preset %r is defined twice (%s and %s): left out of the trigger form", p.name,
                      out[p.name].source, path)
            out.pop(p.name)
            continue
        out[p.name] = p
    return out


def preset(name: str) -> Preset:
    """The preset of that name; ConfigError lists the known ones."""
    if not isinstance(name, str) or not re.fullmatch(PRESET_NAME, name):
        raise ConfigError(f"preset {str(name)[:80]!r} is not a preset name (lower-case letters, digits, '_', '-')")
    dirs = preset_dirs()
    found = [d / f"{name}.toml" for d in dirs if (d / f"{name}.toml").is_file()]
    if not found:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(sorted(form_presets())) or 'none'} "
                          f"(or add {name}.toml to a folder named by ${PRESET_ENV})")
    if len(found) > 1:
        raise ConfigError(f"preset {name!r} is defined twice: {found[0]} and {found[1]}; rename one")
    return load_preset_file(found[0])


def _canonical(value: Any) -> str:
    """A value as compared with a default: numbers as floats (the form sends 30 for 30.0), booleans apart."""
    def norm(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int | float | list | dict):
            return v
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return float(v)

    return json.dumps(norm(value), sort_keys=True)


def at_default(name: str, value: Any, base: dict[str, Any] | None = None) -> bool:
    """Whether ``value`` of the form field ``name`` is what the form shows when it opens (null for a required
    field, or "" for an optional one, count as the default too: to_config reads them so). ``base``: defaults()."""
    f = form.BY_NAME[name]
    if value is None and not f.nullable:
        return True
    if value == "" and f.nullable:
        value = None
    return _canonical(value) == _canonical((base or form.defaults())[name])


def apply_preset(flat: dict[str, Any]) -> tuple[dict[str, Any], PresetUse | None]:
    """``flat`` without its ``preset`` key, that preset's values overlaid: a preset value goes into a field that is
    missing or at its default; a field holding any other value was changed by the person and keeps it. Airflow's
    form sends every field, defaults included, so the value is the only sign of a change there is."""
    flat = dict(flat)
    name = flat.pop(form.PRESET, None)
    if name is None or name == "":
        return flat, None
    chosen = preset(name)
    base = form.defaults()
    done, kept = {}, {}
    for key, value in chosen.values.items():
        if key not in flat or at_default(key, flat[key], base):
            flat[key] = done[key] = value
        else:
            kept[key] = flat[key]
    return flat, PresetUse(chosen.name, chosen.source, done, kept)


def preset_schema() -> dict[str, Any]:
    """The trigger form's ``preset`` field: a select of the presets the form offers, none by default."""
    found = form_presets()
    names = sorted(found)
    return {
        "type": ["null", "string"], "enum": [None, *names], "title": "Preset",
        "values_display": {"null": "none: the values below as they stand",
                           **{n: f"{n} - {found[n].description}" for n in names}},
        "description": "A named kind of run (quick, capacity, soak, runbook, or the operator's own from "
                       f"${PRESET_ENV}). It fills in the fields you leave at their defaults, here and in the closed "
                       "sections below; a field you changed keeps your value (set a field back to its default and "
                       "the preset's value applies). The validate task's log and the run's run.json list what it "
                       "set. Empty: no preset.",
    }
