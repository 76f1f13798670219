"""KV-event bytes against vLLM 0.33's payloads (kv-events.md §9.2); the publisher over real sockets."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq

from cortex.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from cortexsim.kv_events import NullEventPublisher, ZmqEventPublisher

H0, H1 = 9561501211280363793, 15292913576410714033

STORED_HEX = (
    "93cb41d954fc4000000091de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf84b146b151"
    "d55111cfd43b57df56b58fb1b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa"
    "626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65"
    "797392c0c0a967726f75705f6964780000"
)
REMOVED_HEX = (
    "93cb41d954fc404000009284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf84b146b151d5"
    "5111a66d656469756da3475055a967726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68"
    "617368657391cfd43b57df56b58fb1a66d656469756da3475055a967726f75705f6964780000"
)
CONTINUATION_HEX = (
    "93cb3ff800000000000092de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfd43b57df56"
    "b58fb1b1706172656e745f626c6f636b5f68617368cf84b146b151d55111a9746f6b656e5f6964739405060708aa626c6f636b"
    "5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c081a474797065b0416c6c426c6f63"
    "6b73436c656172656401"
)


def stored_two_blocks(**extra: object) -> BlockStored:
    return BlockStored(block_hashes=[H0, H1], parent_block_hash=None, token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                       block_size=4, lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None],
                       group_idx=0, **extra)  # type: ignore[arg-type]


# --- bytes ----------------------------------------------------------------------------------------


def test_block_stored_bytes() -> None:
    batch = KVEventBatch(ts=1700000000.0, events=[stored_two_blocks()], data_parallel_rank=0)
    assert encode_batch(batch).hex() == STORED_HEX


def test_block_stored_with_spec_kind_bytes() -> None:
    batch = KVEventBatch(ts=1700000000.0, events=[stored_two_blocks(kv_cache_spec_kind="full_attention")],
                         data_parallel_rank=0)
    expected = STORED_HEX.replace("de000a", "de000b", 1)[:-2] + (
        "b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00")
    assert encode_batch(batch).hex() == expected


def test_block_removed_bytes() -> None:
    batch = KVEventBatch(ts=1700000001.0, events=[BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)
                                                  for h in (H0, H1)], data_parallel_rank=0)
    assert encode_batch(batch).hex() == REMOVED_HEX


def test_continuation_and_clear_bytes() -> None:
    stored = BlockStored(block_hashes=[H1], parent_block_hash=H0, token_ids=[5, 6, 7, 8], block_size=4,
                         lora_id=None, medium="GPU", lora_name=None)
    batch = KVEventBatch(ts=1.5, events=[stored, AllBlocksCleared()], data_parallel_rank=1)
    assert encode_batch(batch).hex() == CONTINUATION_HEX


def test_empty_batch_keeps_trailing_rank() -> None:
    assert encode_batch(KVEventBatch(ts=1.5, events=[])).hex() == "93cb3ff800000000000090c0"


def test_raw_digest_mode_is_msgpack_bin() -> None:
    digest = bytes.fromhex("58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111")
    event = BlockRemoved(block_hashes=[digest], medium="GPU")
    assert "91c420" + digest.hex() in msgspec.msgpack.encode(event).hex()


def test_decode_round_trip() -> None:
    batch = decode_batch(bytes.fromhex(CONTINUATION_HEX))
    assert batch.data_parallel_rank == 1
    assert batch.events == [BlockStored(block_hashes=[H1], parent_block_hash=H0, token_ids=[5, 6, 7, 8],
                                        block_size=4, lora_id=None, medium="GPU", lora_name=None),
                            AllBlocksCleared()]


# --- publisher ------------------------------------------------------------------------------------


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def batch(n: int) -> KVEventBatch:
    return KVEventBatch(ts=float(n), events=[BlockRemoved(block_hashes=[n], medium="GPU", group_idx=0)])


def recv(sock: zmq.Socket[bytes], timeout_ms: int = 5000) -> list[bytes]:
    if not sock.poll(timeout_ms):
        raise AssertionError("no message within the timeout")
    return sock.recv_multipart()


def replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out: list[list[bytes]] = []
    while True:
        frames = recv(dealer)
        out.append(frames)
        if frames[2] == END_SEQ:
            dealer.close(linger=0)
            return out


def test_live_frames_and_sequence(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = ZmqEventPublisher(0, topic="kv@w1@M", replay_port=0)
    try:
        assert pub.endpoint is not None and pub.endpoint.startswith("tcp://127.0.0.1:")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        # PUB drops messages until the subscription arrives (slow joiner): publish until one lands.
        n = 0
        while True:
            pub.publish(batch(n))
            n += 1
            if sub.poll(50):
                break
            assert n < 200, "subscriber never joined"
        first = sub.recv_multipart()
        assert len(first) == 3 and first[0] == b"kv@w1@M"
        first_seq = int.from_bytes(first[1], "big")
        for extra in range(3):
            pub.publish(batch(1000 + extra))
        received = [first]
        while int.from_bytes(received[-1][1], "big") < n + 2:
            received.append(recv(sub))
        seqs = [int.from_bytes(f[1], "big") for f in received]
        assert seqs == list(range(first_seq, n + 3))
        assert all(len(f[1]) == 8 for f in received)
        last = decode_batch(received[-1][2])
        assert last.events == [BlockRemoved(block_hashes=[1002], medium="GPU", group_idx=0)]
        assert last.data_parallel_rank == 0  # filled in by the publisher
        # Replay from 0 proves the sequence started at 0, including batches the SUB missed.
        assert pub.replay_endpoint is not None
        frames = replay(ctx, pub.replay_endpoint, 0)
        assert [int.from_bytes(f[2], "big") for f in frames[:-1]] == list(range(n + 3))
        sub.close(linger=0)
    finally:
        pub.close()


def test_replay_protocol(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = ZmqEventPublisher(0, topic="t", replay_port=0, buffer_steps=4)
    try:
        for n in range(6):
            pub.publish(batch(n))
        assert pub.flush(5)
        assert pub.replay_endpoint is not None
        frames = replay(ctx, pub.replay_endpoint, 3)
        # DEALER view: [b"", topic, seq, payload] per batch, then [b"", b"", ff*8, b""].
        assert frames[-1] == [b"", b"", b"\xff" * 8, b""]
        assert [f[:2] for f in frames[:-1]] == [[b"", b"t"]] * 3
        assert [int.from_bytes(f[2], "big") for f in frames[:-1]] == [3, 4, 5]
        expected = KVEventBatch(ts=3.0, events=batch(3).events, data_parallel_rank=0)
        assert frames[0][3] == encode_batch(expected)
        # Older than the ring buffer: the oldest kept batches, no error (the client sees seq > start).
        assert [int.from_bytes(f[2], "big") for f in replay(ctx, pub.replay_endpoint, 0)[:-1]] == [2, 3, 4, 5]
        assert len(replay(ctx, pub.replay_endpoint, 99)) == 1
        # A malformed request is ignored and the socket keeps serving.
        bad = ctx.socket(zmq.DEALER)
        bad.connect(pub.replay_endpoint)
        bad.send_multipart([b"", b"x", b"y"])
        assert [int.from_bytes(f[2], "big") for f in replay(ctx, pub.replay_endpoint, 5)[:-1]] == [5]
        assert not bad.poll(0)
        bad.close(linger=0)
    finally:
        pub.close()


def test_close_sends_everything_and_frees_the_port() -> None:
    pub = ZmqEventPublisher(0)
    assert pub.endpoint is not None
    port = int(pub.endpoint.rsplit(":", 1)[1])
    for n in range(50):
        pub.publish(batch(n))
    pub.close()
    with pytest.raises(RuntimeError):
        pub.publish(batch(0))
    again = ZmqEventPublisher(port)
    assert again.endpoint == f"tcp://127.0.0.1:{port}"
    again.close()


def test_busy_port_fails_at_construction() -> None:
    pub = ZmqEventPublisher(0)
    try:
        assert pub.endpoint is not None
        with pytest.raises(zmq.ZMQError):
            ZmqEventPublisher(int(pub.endpoint.rsplit(":", 1)[1]))
    finally:
        pub.close()


def test_null_publisher_accepts_and_drops() -> None:
    null = NullEventPublisher()
    null.publish(batch(1))
    assert null.flush() and null.endpoint is None
    null.close()
