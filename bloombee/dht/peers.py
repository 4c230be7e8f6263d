"""Starting hivemind DHT peers with NAT traversal switched off whenever they bind only to loopback."""

import ipaddress
import logging
from typing import Sequence

import hivemind
from hivemind.utils.multiaddr import Multiaddr

from bloombee.dht.addresses import LOOPBACK_MADDRS
from bloombee.dht.lifecycle import GuardedDHT

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

    Its child process and p2p daemon end with this process (GuardedDHT). Raises TimeoutError, with both
    freed, when the peer is not up and joined to `initial_peers` within `connect_timeout` seconds."""
    nat = nat_traversal_enabled(host_maddrs, nat_traversal)
    dht = GuardedDHT(
        initial_peers=list(initial_peers),
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) or None,
        identity_path=identity_path,
        client_mode=client_mode,
        nat_port_map=nat,
        auto_nat=nat,
        use_relay=nat,
        use_auto_relay=nat,
        use_ipfs=False,
        ensure_bootstrap_success=bool(initial_peers),
        start=False,
    )
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
