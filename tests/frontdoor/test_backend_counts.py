"""How the runtime API's `show stat` becomes a backend's queued and in-flight counts
(haproxy.RuntimeAPI.backend), pure: a fixed answer in HAProxy 2.6's CSV, as its socket
gives it, so each row's part in the sum is seen on its own. What HAProxy itself counts
where (the BACKEND row's scur includes requests waiting in a queue, in a Lua action or on
the hold server) was measured over a real HAProxy: tests/frontdoor/test_tenants.py and
test_hold.py read these counts while requests wait."""

from __future__ import annotations

import pytest

from numad_infer.frontdoor.haproxy import HaproxyError, RuntimeAPI

HEADER = "# pxname,svname,qcur,qmax,scur,smax,slim,stot,status,check_status\n"


class Answered(RuntimeAPI):
    """A runtime API whose socket answers `show stat` with the given rows."""

    def __init__(self, rows: list[str]) -> None:
        super().__init__("/nonexistent.sock")
        self.text = HEADER + "".join(row + "\n" for row in rows)

    def command(self, line: str) -> str:
        assert line == "show stat"
        return self.text


def test_in_flight_is_at_the_instances_and_queued_is_the_rest_of_the_backend() -> None:
    """Two instances serving 2 and 1, the spare idle, the hold server holding 1; the backend
    holds 7: 3 in flight (the hold server's one is not at an instance), 4 waiting (its
    queue, a server's own queue, the batch wait and the hold server)."""
    api = Answered(["frontend,FRONTEND,,,9,,,,OPEN,",
                    "models,infer-0,1,,2,,2,50,UP,L7OK",
                    "models,infer-1,0,,1,,2,40,UP,L7OK",
                    "models,surge-models,0,,0,,2,0,MAINT,",
                    "models,hold-models,0,,1,,32,3,UP,",
                    "models,BACKEND,2,,7,,,93,UP,",
                    "other,infer-2,0,,5,,8,5,UP,L7OK",
                    "other,BACKEND,0,,5,,,5,UP,"])
    stat = api.backend("models")
    assert (stat.in_flight, stat.queued) == (3, 4)
    assert set(stat.servers) == {"infer-0", "infer-1", "surge-models", "hold-models"}
    assert set(stat.instances) == {"infer-0", "infer-1"}
    assert (stat.servers["infer-0"].in_flight, stat.servers["infer-0"].queued) == (2, 1)
    assert api.backend("other").queued == 0 and api.backend("other").in_flight == 5


def test_a_request_let_go_by_the_hold_and_counted_twice_never_makes_the_queue_negative() -> None:
    """Once let go, a request passes through its backend again (hold.py) and HAProxy counts
    it at its instance while the backend's own count has not caught up: never below 0."""
    api = Answered(["models,infer-0,0,,2,,2,9,UP,L7OK",
                    "models,hold-models,0,,0,,32,1,UP,",
                    "models,BACKEND,0,,1,,,10,UP,"])
    stat = api.backend("models")
    assert (stat.in_flight, stat.queued) == (2, 0)


def test_a_backend_missing_from_the_answer_is_an_error_not_an_empty_one() -> None:
    """A reload that dropped the model's backend, or another HAProxy on the socket: said,
    not read as an idle backend with nothing in flight."""
    api = Answered(["models,infer-0,0,,0,,2,0,UP,L7OK", "models,BACKEND,0,,0,,,0,UP,"])
    with pytest.raises(HaproxyError, match="no backend 'gone'"):
        api.backend("gone")
