"""Every key of the `ple:` block is taken as written or refused, naming the key.

No inf or nan (an infinite heartbeat deadline turns liveness off, an infinite step deadline
overflows the nanosecond clock later), no bool or string for a count or a flag, no float for a
count, and no deadline so long that a stuck replica would never end.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from ray_ple.config import PleConfig, PleDeadlines, parse_ple
from ray_ple.errors import PleConfigError

BAD = [
    # (the `ple:` block, the key the error must name)
    ({"deadlines": {"step_s": math.inf}}, "ple.deadlines.step_s"),
    ({"deadlines": {"step_s": math.nan}}, "ple.deadlines.step_s"),
    ({"deadlines": {"step_s": 3601}}, "ple.deadlines.step_s"),
    ({"deadlines": {"step_s": True}}, "ple.deadlines.step_s"),
    ({"deadlines": {"step_s": "60"}}, "ple.deadlines.step_s"),
    ({"deadlines": {"heartbeat_s": math.inf}}, "ple.deadlines.heartbeat_s"),
    ({"deadlines": {"heartbeat_s": 3601.0}}, "ple.deadlines.heartbeat_s"),
    ({"deadlines": {"startup_s": math.inf}}, "ple.deadlines.startup_s"),
    ({"deadlines": {"startup_s": 86401}}, "ple.deadlines.startup_s"),
    ({"deadlines": {"offload_wait_s": -math.inf}}, "ple.deadlines.offload_wait_s"),
    ({"deadlines": {"offload_wait_s": 3601}}, "ple.deadlines.offload_wait_s"),
    ({"supervisor": {"poll_interval_s": math.nan}}, "ple.supervisor.poll_interval_s"),
    ({"supervisor": {"heartbeat_interval_s": math.inf}},
     "ple.supervisor.heartbeat_interval_s"),
    ({"supervisor": {"heartbeat_interval_s": False}}, "ple.supervisor.heartbeat_interval_s"),
    ({"max_tokens": True}, "ple.max_tokens"),
    ({"max_tokens": (1 << 18) + 1}, "ple.max_tokens"),
    ({"supervisor": {"poll_interval_s": 0.0005}}, "ple.supervisor.poll_interval_s"),
    ({"supervisor": {"heartbeat_interval_s": 0.0001}}, "ple.supervisor.heartbeat_interval_s"),
    ({"deadlines": {"heartbeat_s": 0.005}}, "ple.deadlines.heartbeat_s"),
    ({"deadlines": {"step_s": 0.001}}, "ple.deadlines.step_s"),
    ({"deadlines": {"offload_wait_s": 0.009}}, "ple.deadlines.offload_wait_s"),
    ({"deadlines": {"startup_s": 0.05}}, "ple.deadlines.startup_s"),
    ({"max_tokens": "8"}, "ple.max_tokens"),
    ({"max_tokens": 8.0}, "ple.max_tokens"),
    ({"gather_threads": True}, "ple.gather_threads"),
    ({"gather_threads": "2"}, "ple.gather_threads"),
    ({"gather_threads": 2.0}, "ple.gather_threads"),
    ({"enabled": "true"}, "ple.enabled"),
    ({"enabled": 1}, "ple.enabled"),
    ({"offload_num_cpus": math.inf}, "ple.offload_num_cpus"),
    ({"offload_num_cpus": "1"}, "ple.offload_num_cpus"),
    ({"offload_spin_us": math.nan}, "ple.offload_spin_us"),
    ({"resident_layers": True}, "ple.resident_layers"),
    ({"parts": True}, "ple.parts"),
]


@pytest.mark.parametrize(("raw", "key"), BAD)
def test_bad_value_is_one_config_error_naming_its_key(raw, key):
    with pytest.raises(PleConfigError) as info:
        parse_ple(raw)
    assert f"{key}:" in str(info.value), str(info.value)


def test_bounds_themselves_and_plain_numbers_are_accepted():
    """The bounds are inclusive, and an int is a valid number of seconds."""
    cfg = parse_ple({"deadlines": {"startup_s": 86400, "step_s": 3600.0, "offload_wait_s": 3600,
                                   "heartbeat_s": 3600}, "max_tokens": 8, "gather_threads": 2,
                     "enabled": True, "offload_num_cpus": 0})
    assert cfg.deadlines == PleDeadlines(startup_s=86400, step_s=3600, offload_wait_s=3600,
                                         heartbeat_s=3600)
    assert cfg.max_tokens == 8 and cfg.gather_threads == 2 and cfg.enabled is True


def test_every_shipped_serve_config_parses():
    """The `ple:` blocks the project ships stay valid under the strict rules."""
    found = 0
    for path in sorted((Path(__file__).parents[1] / "serve_configs").glob("*.yaml")):
        for app in yaml.safe_load(path.read_text()).get("applications", []):
            for llm in app.get("args", {}).get("llm_configs", []):
                assert isinstance(parse_ple(llm.get("ple")), PleConfig), path.name
                found += 1
    assert found > 0
