"""Signed and schema-checked DHT records: a second peer can neither overwrite, forge nor plant bad records."""

import logging

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.proto import crypto_pb2
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from bloombee.dht.addresses import LOOPBACK_MADDRS
from bloombee.dht.peers import start_dht
from bloombee.dht.records import (
    MODELS_KEY,
    RECORD_SCHEMAS,
    ModelEntry,
    ServerRecord,
    ServerState,
    announce,
    announce_model,
    block_key,
    fetch_models,
    fetch_records,
)
from bloombee.dht.security import MAX_RECORD_BYTES, RecordSchemaValidator, load_identity, owner_peer_id, owner_subkey


class Forger(RSASignatureValidator):
    """An attacker's validator: signs the records it owns, stores whatever it is given (checks nothing)."""

    def validate(self, record) -> bool:
        return True


def honest_record() -> ServerRecord:
    return ServerRecord(state=ServerState.ONLINE, start_block=0, end_block=4, throughput=10.0, link_bandwidth=12.5e6,
                        cache_tokens_left=1000, dtype="float32", device="cpu", version="0.1.0", public_name="honest")


def key_id(key: str) -> str:
    """How the validators' log lines name a key."""
    return DHTID.generate(source=key).to_bytes().hex()[:16]


@pytest.fixture
def security_log(tmp_path):
    """Lines the record validators log in this process and the DHT processes forked from it: (pid, message)."""
    path = tmp_path / "security.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(process)d %(message)s"))
    security = logging.getLogger("bloombee.dht.security")
    level = security.level
    security.addHandler(handler)
    security.setLevel(logging.WARNING)
    yield lambda: [tuple(line.split(" ", 1)) for line in path.read_text().splitlines()]
    security.removeHandler(handler)
    security.setLevel(level)
    handler.close()


def test_a_second_peer_can_neither_overwrite_nor_forge_nor_plant_bad_records(security_log):
    server = start_dht()
    maddrs = [str(maddr) for maddr in server.get_visible_maddrs()]
    attacker_key = RSAPrivateKey()
    attacker = hivemind.DHT(initial_peers=maddrs, host_maddrs=list(LOOPBACK_MADDRS), use_ipfs=False, start=True,
                            record_validators=[Forger(attacker_key)])
    reader = start_dht(maddrs, client_mode=True)
    try:
        server_id = server.peer_id.to_base58()
        now = get_dht_time()
        announce(server, "m", honest_record(), now + 30)
        announce_model(server, "m", ModelEntry(model="honest-model", num_blocks=4), now + 30)
        attacker_subkey = owner_subkey(attacker_key)  # not its libp2p identity: the records name that key's peer id
        attacker_id = owner_peer_id(attacker_subkey)
        assert attacker_id not in (server_id, attacker.peer_id.to_base58())

        forged = honest_record().model_copy(update={"throughput": 1e9, "public_name": "forged"}).model_dump(mode="json")
        # (a) overwrite the server's records under its own subkey, with a later expiration
        attacker.store(block_key("m", 0), forged, now + 60, subkey=server.owner_subkey)
        attacker.store(MODELS_KEY, {"prefix": "m", "model": "evil", "num_blocks": 99}, now + 60,
                       subkey=server.owner_subkey)
        # (b) a signed record that names the server's peer id and maddrs, under the attacker's own key
        attacker.store(block_key("m", 1), {**forged, "peer_id": server_id}, now + 60, subkey=attacker_subkey)
        attacker.store(MODELS_KEY, {"prefix": "evil", "model": "evil", "num_blocks": 99}, now + 60,
                       subkey=attacker_subkey)
        # (c) signed, but malformed or oversized
        attacker.store(block_key("m", 2), {"state": "online", "garbage": True}, now + 60, subkey=attacker_subkey)
        for _ in range(2):  # a second read logs nothing new
            per_block = fetch_records(reader, "m", 4)
        assert [per_block[block][server_id] for block in range(4)] == [honest_record()] * 4
        assert [sorted(records) for records in per_block] == [[server_id], sorted([server_id, attacker_id]),
                                                              [server_id], [server_id]]
        assert per_block[1][attacker_id].public_name == "forged"  # the forgery only speaks for the attacker
        assert fetch_models(reader) == {"m": ModelEntry(model="honest-model", num_blocks=4),
                                        "evil": ModelEntry(model="evil", num_blocks=99)}

        lines = security_log()
        for pid in (server.pid, reader.pid):  # refused on store by the server, on read by the reader: once each
            logged = [message for process, message in lines if process == str(pid)]
            assert sum(key_id("m.2") in message and "malformed" in message for message in logged) == 1, logged
        assert all(attacker_id in message for _, message in lines)
    finally:
        reader.shutdown()
        attacker.shutdown()
        server.shutdown()


def test_an_oversized_signed_record_is_refused():
    """Through the DHT the attacker's own store of such a record can hang (hivemind), so the validator is asked
    directly: a correctly signed record over MAX_RECORD_BYTES is refused."""
    key = RSAPrivateKey()
    signer = RSASignatureValidator(key)
    oversized = {**honest_record().model_dump(mode="json"), "public_name": "x" * MAX_RECORD_BYTES}
    record = DHTRecord(key=DHTID.generate(source=block_key("m", 3)).to_bytes(),
                       subkey=MSGPackSerializer.dumps(owner_subkey(key)),
                       value=signer.sign_value(DHTRecord(b"", b"", MSGPackSerializer.dumps(oversized), 0.0)),
                       expiration_time=get_dht_time() + 60)
    assert not RecordSchemaValidator(RECORD_SCHEMAS).validate(record)
    fitting = DHTRecord(record.key, record.subkey, MSGPackSerializer.dumps(honest_record().model_dump(mode="json")),
                        record.expiration_time)
    assert RecordSchemaValidator(RECORD_SCHEMAS).validate(fitting)


def test_identity_file_keeps_the_peer_id_and_is_the_record_owner(tmp_path):
    path = str(tmp_path / "identity.key")
    first = start_dht(identity_path=path)
    first_id, first_subkey = first.peer_id.to_base58(), first.owner_subkey
    first.shutdown()
    again = start_dht(identity_path=path)
    try:
        assert again.peer_id.to_base58() == first_id == owner_peer_id(first_subkey)
        assert again.owner_subkey == first_subkey
    finally:
        again.shutdown()


def test_an_identity_that_is_not_rsa_is_refused(tmp_path):
    path = tmp_path / "ed25519.key"
    path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"\0" * 64).SerializeToString())
    with pytest.raises(ValueError, match="holds a Ed25519 key"):
        load_identity(str(path))
