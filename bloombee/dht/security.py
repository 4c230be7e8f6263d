"""Signed, schema-checked DHT records: one RSA key is both a peer's libp2p identity and the owner of its records.

Every bloombee peer starts its DHT with `record_validators(key, RECORD_SCHEMAS)` (bloombee.dht.peers.start_dht),
so every peer checks every record it is asked to store and every record another peer returns to it:
- hivemind's RSASignatureValidator: a record whose subkey is `[owner:<RSA public key>]` must be signed by
  that key's private half, so nobody else can store or overwrite it;
- RecordSchemaValidator: every record must be owned so (the subkey is exactly that marker), at most
  MAX_RECORD_BYTES long, and a valid ServerRecord or ModelListing. A refused record is logged once per process.
Readers take a record's server peer id from the owner key itself (`owner_peer_id`): the key is the peer's
libp2p identity, so a record can name no peer but the one holding the key that signed it.
What this does not stop: a peer may announce whatever it likes about itself (throughput, blocks, a model
listing naming another model's prefix), replay its own older signed records to nodes that lack newer ones
(storage keeps the latest expiration per subkey), or, placed among a key's nearest nodes, withhold records.
"""

import hashlib
import logging
import os
import re
from functools import lru_cache
from typing import Any

import msgpack
import multihash
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import BaseModel, ValidationError

logger = logging.getLogger(__name__)

MAX_RECORD_BYTES = 16 * 1024  # a record with a planner profile takes a few KB
MAX_REPORTED = 4096  # refused records remembered so each is logged once; forgotten all at once past this
_OWNER_RE = re.compile(rb"\[owner:(.+)\]", re.DOTALL)
_DECODE_ERRORS = (ValueError, TypeError, msgpack.UnpackException)  # what MSGPackSerializer.loads raises on garbage


def load_identity(path: str) -> RSAPrivateKey:
    """The RSA private key in a libp2p identity file (hivemind's format), generated there first if missing."""
    if not os.path.isfile(path):
        P2P.generate_identity(path)
    with open(path, "rb") as file:
        identity = crypto_pb2.PrivateKey.FromString(file.read())
    if identity.key_type != crypto_pb2.KeyType.RSA:
        raise ValueError(f"identity {path} holds a {crypto_pb2.KeyType.Name(identity.key_type)} key; bloombee signs "
                         "its DHT records with the peer's identity key and needs an RSA one (delete the file to get one)")
    key = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind has no loader: build it as unpickling does
    key.__setstate__({"_private_key": identity.data})
    return key


def record_validators(key: RSAPrivateKey, schemas: tuple[type[BaseModel], ...]) -> list[RecordValidatorBase]:
    """The validators every bloombee DHT peer runs, signing with `key` (the peer's identity key)."""
    return [RSASignatureValidator(key), RecordSchemaValidator(schemas)]


def owner_subkey(key: RSAPrivateKey) -> bytes:
    """The subkey a peer stores its records under: the owner marker of its public key."""
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


def owner_peer_id(subkey: Any) -> str | None:
    """The base58 libp2p peer id of the RSA key in an `[owner:...]` subkey; None when it holds no such key."""
    return _marker_peer_id(subkey) if isinstance(subkey, bytes) else None


@lru_cache(maxsize=1024)
def _marker_peer_id(subkey: bytes) -> str | None:
    """owner_peer_id of a bytes subkey (cached: readers see the same few keys on every fetch)."""
    match = _OWNER_RE.fullmatch(subkey)
    if match is None:
        return None
    try:
        public_key = serialization.load_ssh_public_key(match.group(1))
    except (ValueError, UnsupportedAlgorithm):
        return None
    if not isinstance(public_key, rsa.RSAPublicKey):
        return None
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), "sha2-256")).to_base58()


class RecordSchemaValidator(RecordValidatorBase):
    """Accepts only owned records of at most MAX_RECORD_BYTES whose value is valid for one of `schemas`."""

    def __init__(self, schemas: tuple[type[BaseModel], ...]):
        self.schemas = schemas
        self._reported: set[bytes] = set()

    def validate(self, record: DHTRecord) -> bool:
        """Whether to keep the record (it has passed the signature check already); logs a refused one once."""
        problem = self._problem(record)
        if problem is not None:
            self._report(record, problem)
        return problem is None

    def _problem(self, record: DHTRecord) -> str | None:
        """What is wrong with the record, or None."""
        if _record_owner(record) is None:
            return "its subkey is no [owner:<RSA key>] marker"
        if len(record.value) > MAX_RECORD_BYTES:
            return f"oversized: {len(record.value)} bytes > {MAX_RECORD_BYTES}"
        try:
            value = MSGPackSerializer.loads(record.value)
        except _DECODE_ERRORS as error:
            return f"undecodable: {error}"
        errors = []
        for schema in self.schemas:
            try:
                schema.model_validate(value)
                return None
            except ValidationError as error:
                errors.append(f"{schema.__name__}: {error.errors()[0]['msg']}")
        return "malformed (" + "; ".join(errors) + ")"

    def _report(self, record: DHTRecord, problem: str) -> None:
        """One log line per refused record and process."""
        digest = hashlib.sha256(record.key + record.subkey + record.value).digest()
        if digest in self._reported:
            return
        if len(self._reported) >= MAX_REPORTED:
            self._reported.clear()
        self._reported.add(digest)
        peer_id = _record_owner(record) or "an unowned subkey"
        logger.warning("Ignoring DHT record under key id %s from %s: %s", record.key.hex()[:16], peer_id, problem)


def _record_owner(record: DHTRecord) -> str | None:
    """The peer id owning a record's (serialized) subkey, or None."""
    try:
        return owner_peer_id(MSGPackSerializer.loads(record.subkey))
    except _DECODE_ERRORS:
        return None
