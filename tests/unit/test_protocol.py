"""The records that cross Triton, the stage specs, and errors with their status (no processes)."""

from __future__ import annotations

import re

import msgspec
import pytest

from trident.core import auth, errors
from trident.core.errors import (
    ERRORS, ForgedRecord, InvalidRequest, LeaseExpired, MalformedRecord, NotFound, PeerUnavailable, PoolExhausted,
    ReplayedRecord, TransferTimeout, TridentError, Unavailable,
)
from trident.core.protocol import (
    MODES, RECORD_VERSION, STAGES, EmbeddingsRecord, HFKVRecord, StandIn, TensorSpec, Transfer, VLLMKVRecord, decode_record,
    stages_for, instance_name, parse_instance,
)


def _record_id(value):
    """A case's id: a record's bytes are sealed with a random nonce, so they name no case (and would differ between
    the suite's two processes)."""
    return "record" if isinstance(value, bytes) else None

META = b"m" * 450  # a NIXL agent's metadata is ~450 bytes


POOL = (1 << 40, 256 << 20)  # the producer's registered send pool: (address, bytes)


def _transfer(nbytes: int, specs: tuple[TensorSpec, ...], expires_at: float = 2e9, at: int = 1 << 40) -> Transfer:
    return Transfer("trident-123-abcdef12", META, POOL, ((at, nbytes),), specs, "0123456789abcdef", expires_at, 1 << 41, b"k" * 16)


def _embeddings(**kw) -> EmbeddingsRecord:
    fields = dict(transfer=_transfer(196 * 512 * 4, (TensorSpec("float32", (196, 512)),)), token_counts=[196],
                  grid_thw=None, image_ids=["f" * 32])
    fields.update(kw)
    return EmbeddingsRecord(**fields)


def _kv() -> HFKVRecord:
    spec = TensorSpec("float32", (1, 8, 213, 64), count=12)
    return HFKVRecord(transfer=_transfer(spec.nbytes, (spec,)), prompt_len=213, first_token=17, rope_delta=-3, seed=5)


@pytest.mark.parametrize("record", [_embeddings(), _kv()], ids=["embeddings", "hf_kv"])
def test_records_round_trip_small_and_typed(record):
    data = record.encode()
    assert len(data) <= 1024
    assert decode_record(data) == record
    assert decode_record(data, type(record)) == record
    assert msgspec.msgpack.decode(auth.verify(data))[0] == f"{type(record).__struct_config__.tag}"
    assert record.transfer.agent_meta not in data and record.transfer.lease_id.encode() not in data  # sealed
    assert type(record).__struct_config__.tag.endswith(f"/{RECORD_VERSION}")


def test_media_stand_ins_round_trip_and_bad_ones_are_refused():
    """The vllm engine's records carry each item's shape (an image's, a clip's frames with their metadata, an audio
    clip's samples with its rate), small; a stand-in no request could bring is refused before anything is made."""
    good = [StandIn([224, 300], image=True), StandIn([8, 56, 56, 3], meta={"fps": 2.0, "frames_indices": [0, 1]}),
            StandIn([32000], dtype="float32", rate=16000)]
    record = _embeddings(token_counts=[196, 16, 50], image_ids=["a" * 32, "b" * 32, "c" * 32], stand_ins=good,
                         transfer=_transfer(262 * 512 * 4, (TensorSpec("float32", (262, 512)),)))
    data = record.encode()
    assert len(data) <= 1024 and decode_record(data, EmbeddingsRecord).stand_ins == good
    for bad, problem in [
        ([StandIn([1 << 15, 1 << 15], image=True)] + good[1:], "not one a request could bring"),
        ([StandIn([224, 0], image=True)] + good[1:], "has shape"),
        ([StandIn([4, 4, 4], image=True)] + good[1:], "not one a request could bring"),
        ([StandIn([16], dtype="object")] + good[1:], "dtype"),
        (good[:2], "2 media stand-ins for 3 items"),
    ]:
        with pytest.raises(MalformedRecord, match=problem):
            decode_record(_embeddings(token_counts=[196, 16, 50], image_ids=["a" * 32, "b" * 32, "c" * 32],
                                      stand_ins=bad, transfer=record.transfer).encode(), EmbeddingsRecord)


def test_a_record_of_the_wrong_kind_is_refused_by_name():
    with pytest.raises(MalformedRecord, match=r"expected a hf_kv/\d+ record, got embeddings/\d+"):
        decode_record(_embeddings().encode(), HFKVRecord)
    with pytest.raises(MalformedRecord, match="expected a vllm_kv"):
        decode_record(_kv().encode(), VLLMKVRecord)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "empty"),
        (b"\xc1garbage", "not a sealed record"),
        (auth.sign(b"\xc1garbage"), "not valid msgpack"),
        (auth.sign(msgspec.msgpack.encode(["embeddings/1", []])), r"'embeddings/1' is not supported here"),
        (auth.sign(msgspec.msgpack.encode({"version": 1})), "kind and format version"),
        (auth.sign(msgspec.msgpack.encode([f"hf_kv/{RECORD_VERSION}", 7])), "malformed"),
        (_embeddings(transfer=_transfer(16, (TensorSpec("float32", (196, 512)),))).encode(), "16 bytes"),
        (_embeddings(transfer=_transfer(16, (TensorSpec("complex", (4,)),))).encode(), "dtype"),
        (_embeddings(transfer=_transfer(16, (TensorSpec("float32", (4,)),))).encode(), "do not hold 196 rows"),
        (_embeddings(image_ids=["a", "b"]).encode(), "token counts and image ids"),
        # where the regions lie: DRAM or a GPU's VRAM, on a device number that can be one
        (_embeddings(transfer=msgspec.structs.replace(_embeddings().transfer, memory="HBM")).encode(),
         "names memory 'HBM' on device 0"),
        (_embeddings(transfer=msgspec.structs.replace(_embeddings().transfer, memory="VRAM", device=-1)).encode(),
         "names memory 'VRAM' on device -1"),
        (_embeddings(token_counts=[0]).encode(), "invalid token counts"),
        (_embeddings(transfer=_transfer(8, (TensorSpec("float16", (1,)), TensorSpec("float32", (1,)), TensorSpec("float16", (1,))))).encode(),
         "float32 tensor at byte 2, not a multiple of its element size"),
        # a zero-size tensor with a huge count (once looped over in unpack_tensors)
        (_embeddings(transfer=_transfer(16, (TensorSpec("float32", (4,)), TensorSpec("float32", (0, 4), 1 << 40)))).encode(),
         "invalid tensor spec"),
    ],
    ids=_record_id,
)
def test_malformed_records_name_the_problem(data, match):
    with pytest.raises(MalformedRecord, match=match):
        decode_record(data)


def test_records_are_signed_with_the_deployment_key(monkeypatch):
    data = _kv().encode()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1  # any one byte changed (here: inside the msgpack)
    with pytest.raises(ForgedRecord, match="not sealed with this deployment's key"):
        decode_record(bytes(flipped))
    with pytest.raises(ForgedRecord):  # no seal at all: msgpack as an attacker would write it, in a sealed frame
        decode_record(data[: -auth.MAC_BYTES] + b"\0" * auth.MAC_BYTES)
    with pytest.raises(MalformedRecord, match="not a sealed record"):
        decode_record(msgspec.msgpack.encode(["hf_kv/7"]) + b"\0" * 40)
    monkeypatch.setenv(auth.ENV, "another deployment's secret")
    with pytest.raises(ForgedRecord):
        decode_record(data)
    assert decode_record(_kv().encode()) == _kv()  # that deployment reads its own records
    assert ForgedRecord.http_status == 403 and ForgedRecord.triton_code == "INVALID_ARG"


def test_regions_outside_the_producers_pool_are_refused():
    inside = _transfer(4096, (TensorSpec("uint8", (4096,)),), at=POOL[0] + POOL[1] - 4096)
    _embeddings(transfer=inside, token_counts=[4096], image_ids=["a"])  # fits exactly
    for at in (POOL[0] - 4096, POOL[0] + POOL[1] - 4095, 1 << 20):
        transfer = _transfer(4096, (TensorSpec("uint8", (4096, 1)),), at=at)
        with pytest.raises(ForgedRecord, match="outside the producer's pool"):
            decode_record(_embeddings(transfer=transfer, token_counts=[4096], image_ids=["a"]).encode())


def test_single_use_refuses_a_replay_and_forgets_expired_records():
    used = auth.SingleUse(limit=4)
    used.claim("a", until=2e9, what="record a")
    with pytest.raises(ReplayedRecord, match="record a was already used"):
        used.claim("a", until=2e9, what="record a")
    for key in "bcd":
        used.claim(key, until=0.0, what=key)  # already expired: forgotten once the table is full
    used.claim("e", until=2e9, what="e")
    used.claim("b", until=2e9, what="b")  # forgotten after its expiry, so accepted (its lease check refuses it)
    with pytest.raises(ReplayedRecord):
        used.claim("a", until=2e9, what="record a")


def test_stage_specs_follow_from_what_a_stage_does():
    assert [s for s, spec in STAGES.items() if spec.decoupled] == ["generate", "decode", "prefill_decode"]
    assert STAGES["prefill"].input_names == ("text_input", "embedding_meta", "sampling_parameters")
    assert [t.name for t in STAGES["encode"].outputs] == ["embedding_meta", "encode_report"]
    # the decode stage takes kv_meta, or a short prompt's embeddings it prefills itself
    decode = {t.name: t.optional for t in STAGES["decode"].inputs}
    assert decode["kv_meta"] and decode["embedding_meta"] and decode["text_input"]
    assert [t.name for t in STAGES["encode_prefill"].outputs] == ["kv_meta"]
    for mode, chain in MODES.items():  # every mode ends in a stage that hands on tokens; records chain up
        specs = [STAGES[s] for s in chain]
        assert specs[-1].hands_on == "tokens"
        for before, after in zip(specs, specs[1:]):
            assert before.hands_on == after.takes, mode
    assert stages_for(["e_p_d", "ep_d"]) == ["encode", "prefill", "decode", "encode_prefill"]


def test_instance_names():
    assert [instance_name("prefill", i) for i in (1, 2, 10)] == ["prefill", "prefill-2", "prefill-10"]
    assert parse_instance("prefill") == ("prefill", 1)
    assert parse_instance("prefill_decode-3") == ("prefill_decode", 3)
    for other in ("e_p_d", "prefill-1", "prefill-02", "prefill-x", "nope-2", "prefill-"):
        assert parse_instance(other) is None, other


def test_error_classes_carry_their_status():
    expected = {
        InvalidRequest: (400, "INVALID_ARG", False), MalformedRecord: (400, "INVALID_ARG", False),
        ForgedRecord: (403, "INVALID_ARG", False), ReplayedRecord: (403, "INVALID_ARG", False),
        NotFound: (404, "NOT_FOUND", False), Unavailable: (503, "UNAVAILABLE", True),
        PeerUnavailable: (503, "UNAVAILABLE", True), PoolExhausted: (503, "UNAVAILABLE", True),
        TransferTimeout: (504, "UNAVAILABLE", True), LeaseExpired: (504, "UNAVAILABLE", True),
        TridentError: (500, "INTERNAL", False), errors.Cancelled: (499, "CANCELLED", False),
    }
    for cls, (status, code, retryable) in expected.items():
        assert (cls.http_status, cls.triton_code, cls.retryable) == (status, code, retryable), cls


@pytest.mark.parametrize("cls", list(ERRORS.values()))
def test_errors_come_back_from_the_message_a_client_reads(cls):
    shown = "in ensemble 'e_p_d', " + errors.client_message(cls("the reason"))
    back = errors.from_message(shown)
    assert type(back) is cls and back.message == "the reason"
    assert errors.from_message("Request for unknown model: 'e_pd' is not found") is None


def test_an_internal_error_shows_a_client_a_reference_and_the_log_its_cause(caplog):
    """A bug's exception text (a path, an address) never reaches a client: the Failure a worker sends, and so the
    client's message, carries a reference; the log has the exception under the same reference."""
    from trident.core.protocol import error_of, failure

    try:
        raise OSError("[Errno 111] Connection refused: 10.1.2.3:41235 /opt/secret/path")
    except OSError as e:
        with caplog.at_level("ERROR", logger="trident"):
            sent = failure(7, e)
    shown = errors.client_message(error_of(sent))
    assert sent.error == "TridentError" and "10.1.2.3" not in shown and "/opt" not in shown
    reference = re.search(r"internal error \(reference ([0-9a-f]{8})", shown).group(1)
    assert [r.getMessage() for r in caplog.records] == [
        f"internal error {reference}: OSError: [Errno 111] Connection refused: 10.1.2.3:41235 /opt/secret/path"]
    assert caplog.records[0].exc_info is not None
    assert errors.as_trident_error(errors.Unavailable("as it is")).message == "as it is"


def test_received_tensors_are_views_of_the_pool_in_the_records_layout():
    """unpack_tensors: views (as_strided) of the bytes the layout puts where; specs that reach past the buffer, or
    put a tensor where its dtype cannot start (a float16 run of odd length before float32), are refused."""
    import torch

    from trident.core.transfer import MemoryPool
    from trident.core.transfer.tensors import unpack_tensors

    pool = MemoryPool("t", 4096)
    tensors = [torch.arange(4, dtype=torch.float16), torch.arange(6, dtype=torch.float32).reshape(2, 3) + 0.5,
               torch.arange(8, dtype=torch.int64).reshape(2, 2, 2), torch.tensor([7, 9], dtype=torch.uint8)]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    region = pool.alloc(flat.numel())
    pool.view(region)[: flat.numel()] = flat
    specs = (TensorSpec("float16", (4,)), TensorSpec("float32", (2, 3)), TensorSpec("int64", (2, 2, 2)),
             TensorSpec("uint8", (2,)))
    views = unpack_tensors(pool.buffer, specs, region.offset, pool.typed)
    for view, want in zip(views, tensors):
        assert view.dtype == want.dtype and view.shape == want.shape and torch.equal(view, want)
    assert views[0].data_ptr() == pool.address_of(region)  # views, not copies
    views[3][0] = 8
    assert int(pool.view(region)[flat.numel() - 2]) == 8
    kv = (TensorSpec("float32", (1, 2, 4, 8), count=12),)  # k and v of 6 layers, the KV record's layout
    assert [v.data_ptr() for v in unpack_tensors(pool.buffer, kv, 256, pool.typed)] == \
        [pool.address + 256 + i * 256 for i in range(12)]
    with pytest.raises(MalformedRecord, match="more than the buffer holds"):
        unpack_tensors(pool.buffer, (TensorSpec("float32", (1024,)),), 256, pool.typed)
    with pytest.raises(MalformedRecord, match="float32 tensor at byte 6, not a multiple of its element size"):
        unpack_tensors(pool.buffer, (TensorSpec("float16", (3,)), TensorSpec("float32", (2,))), 256, pool.typed)


def test_a_lost_worker_on_another_host_is_named_by_its_stage_never_its_address():
    from trident.core.stagecall.client import lost_message

    remote = lost_message("prefill-2", {"tcp": ["198.18.7.3", 41235], "pid": 77})
    assert remote == "the prefill-2 stage's worker on another host went away; the request was lost with it"
    local = lost_message("prefill", {"tcp": ["127.0.0.1", 41235], "direct": "/tmp/x/calls.sock", "pid": 77})
    assert local.startswith("the prefill stage's worker (pid 77) exited")


def test_a_bind_is_sealed_with_the_secret_and_taken_once():
    from trident.core.errors import Unauthenticated
    from trident.core.protocol import Bind, open_bind, seal_bind

    request = Bind(stage="prefill", tcp=("10.0.0.2", 4100), instances=2)
    taken: set[str] = set()

    def take(nonce: str) -> bool:
        new = nonce not in taken
        taken.add(nonce)
        return new

    sealed = seal_bind(request)
    assert open_bind(sealed, take) == request
    with pytest.raises(Unauthenticated, match="already taken"):
        open_bind(sealed, take)  # a replay
    mac, body = sealed.split(b".", 1)
    for forged in (mac + b"." + body.replace(b"4100", b"4101"), b"0" * 64 + b"." + body, body):
        with pytest.raises(Unauthenticated, match="sealed with the deployment secret"):
            open_bind(forged, take)
    assert open_bind(seal_bind(request), take) == request  # (a new one: a new nonce)


@pytest.mark.parametrize("url, ssl", [("https://head.example:443", True), ("http://10.0.0.1:8000", False),
                                      ("10.0.0.1:8000", False)])
def test_a_worker_asks_the_bind_model_with_the_url_s_scheme(monkeypatch, url, ssl):
    """A worker joining through a TLS terminator (``--join https://...``) talks TLS to it: the scheme is kept."""
    import tritonclient.http as httpclient

    from trident.core import bind_call
    from trident.core.protocol import Bind

    made = {}

    class Client:
        def __init__(self, address, ssl=False, **kwargs):
            made.update(address=address, ssl=ssl)
            raise OSError("stop here")

    monkeypatch.setattr(httpclient, "InferenceServerClient", Client)
    with pytest.raises(OSError, match="stop here"):
        bind_call.ask(url, Bind(stage="prefill", tcp=("10.0.0.2", 4100)), 1.0)
    assert made == {"address": url.rpartition("://")[2], "ssl": ssl}


def test_a_bind_whose_answer_never_comes_is_asked_again_within_a_minute(monkeypatch):
    """An ask the head never answers (its Triton died under it and was started again) waits at most ``ASK_S``, then
    the worker asks again (the bind model gives the same worker its name back if that bind went through)."""
    from trident.core.protocol import Bind
    from trident.worker import bind

    waits: list[float] = []

    def ask(url, request, timeout_s):
        waits.append(timeout_s)
        if len(waits) == 1:
            raise OSError("timed out")
        return "encode"

    monkeypatch.setattr(bind, "ask", ask)
    monkeypatch.setattr(bind.time, "sleep", lambda s: None)
    assert bind.bind("http://head:8000", Bind(stage="encode", tcp=("10.0.0.2", 4100))) == "encode"
    assert len(waits) == 2 and all(0 < w <= bind.ASK_S < bind.BIND_S for w in waits)
