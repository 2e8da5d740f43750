"""Multi-turn conversations: a simulated user keeps talking in one chat for a few
turns, each request carrying the conversation so far (so its prefix is cached),
before it starts a new one from a freshly drawn template."""

from __future__ import annotations

from loadsim.users import PATHS, PlannedRequest, SimulatedUser


class ChatSession:
    """Plans a user's requests turn by turn. Chat templates last 1..max_turns turns
    (drawn per conversation); completions and failed turns end the conversation."""

    def __init__(self, user: SimulatedUser, max_turns: int = 1) -> None:
        self.user = user
        self._max_turns = max_turns
        self._previous: PlannedRequest | None = None
        self._reply: str | None = None
        self._turns_left = 0
        self.turn = 0                       # 1 for a conversation's first request

    def next_request(self) -> PlannedRequest:
        if self._previous is not None and self._reply is not None and self._turns_left > 0:
            request = self.user.follow_up(self._previous, self._reply)
            self.turn += 1
        else:
            request = self.user.next_request()
            chat = request.path == PATHS["chat"]
            self._turns_left = self.user.session_turns(self._max_turns) if chat else 1
            self.turn = 1
        self._turns_left -= 1
        self._previous, self._reply = request, None
        return request

    def answered(self, reply: str | None) -> None:
        """The last request's full answer, or None when it failed or was cut short
        (the next request then starts a new conversation)."""
        self._reply = reply
        if reply is None:
            self._turns_left = 0
