"""Default listen addresses and the check of a peer address (light: hivemind is imported only to parse one)."""

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)


def peer_address_problem(address: str) -> str | None:
    """Why `address` is not a multiaddr of a peer (/ip4/HOST/tcp/PORT/p2p/PEER_ID), or None."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        protocols = [protocol.name for protocol, _ in Multiaddr(address).items()]
    except Exception as error:  # multiaddr raises several unrelated types for malformed text
        return f"is not a multiaddr ({type(error).__name__}: {error})"
    if "p2p" not in protocols:
        return "has no /p2p/PEER_ID part"
    return None
