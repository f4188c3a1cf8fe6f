import signal
import sys

import pytest

from adloco.run.stopping import StopSignals


def _a_generator_that_is_interrupted_while_it_closes():
    try:
        yield
    finally:
        signal.raise_signal(signal.SIGINT)


def test_a_ctrl_c_swallowed_by_a_finalizer_still_stops_the_run(monkeypatch):
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: swallowed.append(unraisable.exc_type))
    with StopSignals() as stop:
        stop.raise_if_interrupted()  # nothing pending: no error
        generator = _a_generator_that_is_interrupted_while_it_closes()
        next(generator)
        del generator  # Python reports the KeyboardInterrupt raised while closing as unraisable; nothing is raised
        assert swallowed == [KeyboardInterrupt]
        with pytest.raises(KeyboardInterrupt):
            stop.raise_if_interrupted()


def test_ctrl_c_raises_at_once_and_the_handlers_come_back():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    with StopSignals() as stop, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert stop.interrupted
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_an_ignored_ctrl_c_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            signal.raise_signal(signal.SIGINT)
        assert not stop.interrupted and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_term_and_usr1_only_ask_for_a_stop_at_the_round_end():
    with StopSignals() as stop:
        signal.raise_signal(signal.SIGUSR1)
        assert stop.requested == signal.SIGUSR1 and not stop.interrupted
