"""haproxy.cfg as data (frontdoor/phases.py): phases in order, each phase's rules in the
order given, no phase a section does not have; and in every golden, the order HAProxy
applies holds: a backend's use-server rules after all its http-request rules."""

from __future__ import annotations

import json
import re

import pytest

from numad_infer.frontdoor import answers, phases
from numad_infer.frontdoor.phases import Phase, rules, section
from tests.frontdoor import golden_haproxy as golden

TWO = (Phase("first", ""), Phase("second", ""))


def test_phases_render_in_their_order_and_rules_in_the_order_given() -> None:
    built = section("backend b", TWO, rules("second", "x", ["    c"]), rules("first", "y", ["    a"]),
                    rules("second", "z", ["    d"]), rules("first", "w", []))
    assert built.lines() == ["backend b", "    a", "    c", "    d"]
    text = phases.render("# m", [built, section("backend e", TWO)])
    assert text == "# m\nbackend b\n    a\n    c\n    d\n\nbackend e\n"


def test_a_rule_for_a_phase_the_section_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="no phase 'third'"):
        section("frontend f", TWO, rules("third", "x", ["    a"]))


@pytest.mark.parametrize("name", golden.cases())
def test_in_every_golden_use_server_comes_after_every_http_request_rule(name: str) -> None:
    for block in golden.golden_path(name).read_text().split("\n\n"):
        lines = block.splitlines()
        uses = [n for n, line in enumerate(lines) if line.startswith(("    use-server ", "    use_backend "))]
        requests = [n for n, line in enumerate(lines) if line.startswith("    http-request ")]
        assert not uses or not requests or max(requests) < min(uses), (name, lines[0])


@pytest.mark.parametrize("name", golden.cases())
def test_every_answer_haproxy_makes_is_json(name: str) -> None:
    for body in re.findall(r"(?:return|http-error) status \d+ content-type application/json string '([^']*)'",
                           golden.golden_path(name).read_text()):
        json.loads(body)
    assert answers.BUSY.headers == (answers.RETRY_AFTER,)
