"""What the red-team tests assert of a refused trigger: validate raises naming the value, and leaves no run.json."""

from __future__ import annotations

import pytest

from deploybench import paths, pipeline
from deploybench.errors import ConfigError


def refused(key: str, conf: dict, *words: str) -> str:
    """validate refuses ``conf`` (on the inventory ``rack``) naming each of ``words`` and leaves no run.json;
    returns its message."""
    with pytest.raises(ConfigError) as exc:
        pipeline.validate(key, {"inventory": "rack", **conf})
    msg = str(exc.value)
    for w in words:
        assert w in msg, msg
    assert not (paths.run_dir(key) / "run.json").exists()
    return msg
