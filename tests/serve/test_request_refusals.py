"""A request field that is a server setting (``max_branches``, ``branches``) is refused with a
400 naming the flag to start the server with."""

from __future__ import annotations

import pytest


def test_the_server_refuses_request_fields_that_are_server_settings():
    from redrafter_mlx.serve.protocol import ProtocolError, parse_chat

    for field, flag in (("max_branches", "--max-branches"), ("branches", "--branches")):
        body = {"messages": [{"role": "user", "content": "hi"}], field: 0}
        with pytest.raises(ProtocolError, match=f"start the server with {flag}") as e:
            parse_chat(body, 64)
        assert e.value.status == 400
