"""Which local network interface reaches the rendezvous host.

gloo binds the address the machine's hostname resolves to unless ``GLOO_SOCKET_IFNAME`` names an
interface. Where the hostname resolves to a loopback or an unreachable address (containers,
network namespaces, hosts with a stale /etc/hosts), ranks on other nodes cannot connect and the
job hangs at its first collective. The interface the kernel routes towards MASTER_ADDR is the
one the peers can reach, so ``init_distributed`` picks it when the user named none.
"""
from __future__ import annotations

import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's primary IPv4 address


def ipv4_of(interface: str) -> str | None:
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", interface[:15].encode()))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_towards(host: str) -> str | None:
    """The name of the interface this machine would use to reach ``host``; None for a loopback
    host, an unresolvable one, or where the interface cannot be told."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return None
    if ip.startswith("127."):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))  # UDP: only picks the route, sends nothing
            local = s.getsockname()[0]
        except OSError:
            return None
    for _, name in socket.if_nameindex():
        if ipv4_of(name) == local:
            return name
    return None
