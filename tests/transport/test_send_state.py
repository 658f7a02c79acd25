"""A stream's sending (transport/grpc.py) as one table, SEND_TRANSITIONS, that the code moves through:
CLOSED is final, every state is reached, and a move the table does not list raises."""

from __future__ import annotations

import pytest

from eds_server.transport.grpc import SEND_TRANSITIONS, SendState, SendStateError, SendStep, send_move

CLOSED = SendState.CLOSED


def test_closed_is_final_and_every_state_is_reached() -> None:
    assert all(after is CLOSED for (before, _), after in SEND_TRANSITIONS.items() if before is CLOSED)
    assert set(SEND_TRANSITIONS.values()) == set(SendState)
    assert all((state, SendStep.END) in SEND_TRANSITIONS for state in SendState)  # ending is always possible


def test_a_move_the_table_does_not_list_raises() -> None:
    """Waiting is the task's move after it sent: from IDLE (already waiting) it is a bug."""
    with pytest.raises(SendStateError, match="WAIT is no move from IDLE"):
        send_move(SendState.IDLE, SendStep.WAIT, "n1")
    with pytest.raises(SendStateError, match="WAKE is no move from CLOSED"):
        send_move(CLOSED, SendStep.WAKE)
    assert send_move(CLOSED, SendStep.HAND_OVER) is CLOSED  # the reader ended after the call did
    assert send_move(SendState.IDLE, SendStep.HAND_OVER) is SendState.SENDING
