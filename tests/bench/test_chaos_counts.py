"""bench/chaos.py's counting with two models: a failure is put down to the other model's
fault only when the last fault struck an instance of another model than the one asked."""

from __future__ import annotations

from bench.chaos import MODEL_NAMES, TWO_MODELS, Tally, model_table


def test_a_failure_during_the_other_models_fault_is_counted_apart() -> None:
    alpha, beta = Tally(model="alpha"), Tally(model="beta")
    for tally in (alpha, beta):
        tally.strike("kill-instance", "beta")
    assert alpha.add("before", "HTTP 503") is False
    assert beta.add("before", "HTTP 502") is False
    assert alpha.add("ok") and beta.add("ok")
    assert alpha.other_model_failed == {"HTTP 503 (after kill-instance of beta)": 1}
    assert not beta.other_model_failed and beta.own_model_failed == 1  # its own model's fault
    assert alpha.own_model_failed == 0
    assert (alpha.sent, alpha.ok, beta.sent, beta.ok) == (2, 1, 2, 1)
    assert beta.before_first_byte == {"HTTP 502 (after kill-instance)": 1}  # causes read as in one-model mode


def test_a_fault_on_what_both_share_is_no_models_and_one_model_mode_counts_as_before() -> None:
    alpha = Tally(model="alpha")
    alpha.strike("kill-haproxy")
    alpha.add("in-flight", "ConnectionResetError")
    alpha.add("cut")
    assert not alpha.other_model_failed
    single = Tally()
    single.strike("kill-instance", "")
    single.add("before", "HTTP 502")
    assert single.before_first_byte == {"HTTP 502 (after kill-instance)": 1} and not single.other_model_failed


def test_reload_one_drops_exactly_one_models_table() -> None:
    config = TWO_MODELS + "[placement]\n\n[server]\nbase_port = 1\n"
    dropped = config.replace(model_table(config, MODEL_NAMES[1]), "")
    assert dropped.count("[[models]]") == 1 and 'name = "alpha"' in dropped and 'name = "beta"' not in dropped
    assert "[placement]\n" in dropped and "base_port = 1" in dropped
