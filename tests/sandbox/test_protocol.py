"""Frames between the pool and its workers survive any content and fail cleanly."""
import os
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.sandbox import _protocol

json_scalars = st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=20)
values = st.recursive(
    json_scalars | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8).filter(lambda k: k != "blob"), inner, max_size=4),
    max_leaves=20)
messages = st.dictionaries(st.text(max_size=8).filter(lambda k: k != "blobs"), values,
                           max_size=6)


@settings(max_examples=60, deadline=None)
@given(messages)
def test_roundtrip_preserves_nested_bytes_and_json(message):
    r, w = os.pipe()
    try:
        frame = _protocol.pack(message)
        writer = threading.Thread(target=os.write, args=(w, frame))  # may exceed the pipe
        writer.start()
        received = _protocol.recv(r, time.monotonic() + 5)
        writer.join()
    finally:
        os.close(r)
        os.close(w)
    assert received == message


def test_closed_channel_and_deadline_raise_their_own_errors():
    r, w = os.pipe()
    os.write(w, _protocol.pack({"a": 1})[:6])  # a torn frame
    with pytest.raises(_protocol.Deadline):
        _protocol.recv(r, time.monotonic() + 0.05)
    os.close(w)
    with pytest.raises(_protocol.Closed):
        _protocol.recv(r, time.monotonic() + 0.05)
    os.close(r)


def test_oversized_frames_are_refused_before_reading_them():
    r, w = os.pipe()
    os.write(w, _protocol.pack({"out": b"x" * 1000}))
    with pytest.raises(ValueError, match="1000"):
        _protocol.recv(r, time.monotonic() + 1, max_bytes=999)
    os.close(r)
    os.close(w)
