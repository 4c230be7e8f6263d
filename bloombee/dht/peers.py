"""Starting hivemind DHT peers with NAT traversal switched off whenever they bind only to loopback."""

import ipaddress
import logging
import os
import tempfile
from typing import Sequence

import hivemind
from hivemind.utils.multiaddr import Multiaddr

from bloombee.dht.addresses import LOOPBACK_MADDRS
from bloombee.dht.lifecycle import GuardedDHT
from bloombee.dht.records import RECORD_SCHEMAS
from bloombee.dht.security import load_identity, owner_subkey, record_validators

logger = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT = 30.0  # seconds to start a DHT peer and join the swarm


def binds_only_loopback(host_maddrs: Sequence[str]) -> bool:
    """True when every host multiaddr names a loopback IP address."""
    for maddr in host_maddrs:
        protocols = Multiaddr(str(maddr)).items()
        ips = [value for proto, value in protocols if proto.name in ("ip4", "ip6")]
        if not ips or not all(ipaddress.ip_address(ip).is_loopback for ip in ips):
            return False
    return True


def nat_traversal_enabled(host_maddrs: Sequence[str], requested: bool | None) -> bool:
    """NAT port mapping, AutoNAT and relays: on by default, never when every address is loopback."""
    if binds_only_loopback(host_maddrs):
        if requested:
            logger.info("NAT traversal requested but every address is loopback: keeping it off")
        return False
    return True if requested is None else requested


def start_dht(
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = LOOPBACK_MADDRS,
    announce_maddrs: Sequence[str] = (),
    identity_path: str | None = None,
    nat_traversal: bool | None = None,
    client_mode: bool = False,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> hivemind.DHT:
    """Start a DHT peer (see nat_traversal_enabled for NAT traversal); no IPFS bootstrap, no public peers.

    Its libp2p identity is an RSA key, from `identity_path` (created there if missing) or fresh, which also
    signs its records; it runs bloombee's record validators (bloombee.dht.security). Its child process and p2p
    daemon end with this process (GuardedDHT). Raises TimeoutError, with both freed, when the peer is not up and
    joined to `initial_peers` within `connect_timeout` seconds."""
    if identity_path is not None:
        return _start_dht(initial_peers, host_maddrs, announce_maddrs, identity_path, os.path.isfile(identity_path),
                          nat_traversal, client_mode, connect_timeout)
    with tempfile.TemporaryDirectory(prefix="bloombee-identity-") as folder:  # the daemon reads it on start only
        return _start_dht(initial_peers, host_maddrs, announce_maddrs, os.path.join(folder, "identity.key"), False,
                          nat_traversal, client_mode, connect_timeout)


def _start_dht(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
               identity_path: str, check_identity_free: bool, nat_traversal: bool | None, client_mode: bool,
               connect_timeout: float) -> hivemind.DHT:
    """start_dht with the identity at `identity_path`; `check_identity_free`: first make sure no peer uses it."""
    nat = nat_traversal_enabled(host_maddrs, nat_traversal)
    key = load_identity(identity_path)
    dht = GuardedDHT(
        initial_peers=list(initial_peers),
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) or None,
        identity_path=identity_path,
        check_if_identity_free=check_identity_free,
        record_validators=record_validators(key, RECORD_SCHEMAS),
        client_mode=client_mode,
        nat_port_map=nat,
        auto_nat=nat,
        use_relay=nat,
        use_auto_relay=nat,
        use_ipfs=False,
        ensure_bootstrap_success=bool(initial_peers),
        start=False,
    )
    dht.owner_subkey = owner_subkey(key)
    try:
        dht.run_in_background(await_ready=True, timeout=connect_timeout)
    except BaseException as error:
        dht.shutdown()
        if isinstance(error, TimeoutError):
            raise TimeoutError(f"the DHT peer did not start and join {list(initial_peers) or 'a new swarm'} within "
                               f"{connect_timeout:g} s; check --initial-peers or raise the connect timeout") from None
        raise
    logger.info("DHT peer %s started (NAT traversal %s)", dht.peer_id, "on" if nat else "off")
    return dht


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """Multiaddrs other peers can pass as --initial-peers, each ending with this peer's id."""
    return [str(maddr) for maddr in dht.get_visible_maddrs()]
