"""kvplug.testing's ports: a kit's start that lost its port to another process starts again on
ports chosen anew, a bounded number of times; servers' words for it are recognised."""

from __future__ import annotations

import os
import socket

import pytest

from kvplug.testing import (
    PortTaken,
    free_ports,
    held_port,
    listening_addresses,
    ports_in_use,
    says_address_in_use,
    start_on_free_ports,
)


def test_a_start_that_lost_its_port_is_tried_again_on_new_ports() -> None:
    outcomes: list[Exception | str] = [PortTaken("taken"), PortTaken("taken"), "started"]
    chosen_again = []

    def start() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert start_on_free_ports(start, lambda: chosen_again.append(1)) == "started"
    assert len(chosen_again) == 2


def test_the_tries_are_bounded_and_the_last_failure_is_raised() -> None:
    starts = []

    def start() -> None:
        starts.append(1)
        raise PortTaken(f"start {len(starts)}: address already in use")

    with pytest.raises(PortTaken, match="start 3:"):
        start_on_free_ports(start, lambda: None, attempts=3)
    assert len(starts) == 3
    with pytest.raises(ValueError, match="attempts must be at least 1, not 0"):
        start_on_free_ports(start, lambda: None, attempts=0)


def test_other_failures_are_not_retried() -> None:
    starts = []

    def start() -> None:
        starts.append(1)
        raise RuntimeError("the model is missing")

    with pytest.raises(RuntimeError, match="model is missing"):
        start_on_free_ports(start, lambda: None)
    assert len(starts) == 1


@pytest.mark.parametrize(
    "text",
    [
        "OSError: [Errno 98] Address already in use",
        "listen tcp 127.0.0.1:8333: bind: address already in use",
        "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): address already in use",
        "Fail to listen: EADDRINUSE",
    ],
)
def test_servers_words_for_a_taken_port(text: str) -> None:
    assert says_address_in_use(text)


def test_other_failures_do_not_read_as_a_taken_port() -> None:
    assert not says_address_in_use("RuntimeError: CUDA out of memory")
    assert not says_address_in_use(
        "ERROR:    [Errno 13] error while attempting to bind on address ('127.0.0.1', 80): permission denied"
    )


def test_a_held_port_cannot_be_bound_and_free_ports_are_distinct() -> None:
    with held_port() as port, socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    ports = free_ports(8)
    assert len(set(ports)) == 8


def test_ports_in_use_are_those_another_socket_holds() -> None:
    [free] = free_ports(1)
    with held_port() as held:
        assert ports_in_use([held, free]) == [held]
        assert ("127.0.0.1", held) in listening_addresses(os.getpid())
    assert ("127.0.0.1", held) not in listening_addresses(os.getpid())
