"""Workers found by DNS: `dns:NAME:PORT` stands for every address NAME resolves to.

On Kubernetes, NAME is a headless Service (`clusterIP: None`): its A/AAAA records are the addresses
of its ready pods, so a scaled StatefulSet or Deployment needs no hand-kept worker list. Each
`dns:` source is looked up every `discovery.interval_s` (gateway/config.py) through the system's
resolver (getaddrinfo: /etc/hosts, /etc/resolv.conf and its search domains, as every other program
on the machine or pod resolves), or, with `discovery.nameservers` configured, by asking those servers
with dnspython's asynchronous resolver; the pool
(gateway/routing.py `WorkerPool.set_members`) takes in the addresses that appeared, health-checks
them before they get traffic, and lets the ones that disappeared finish what they have.

A lookup that fails (timeout, SERVFAIL, no nameserver answering) changes nothing: the members
already known stay, and the failure is logged once. A name that does not exist, or has no
records, is an empty source (a Service scaled to zero).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import Discovery as DiscoverySettings

log = logging.getLogger("flowprefill.gateway")

PREFIX = "dns:"


@dataclass(frozen=True)
class DnsTarget:
    """`dns:NAME:PORT`: workers at each address of NAME, on PORT, spoken to over http."""

    name: str
    port: int

    def __str__(self) -> str:
        return f"{PREFIX}{self.name}:{self.port}"

    def url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address  # an IPv6 address in a URL
        return f"http://{host}:{self.port}"


def parse_target(source: str) -> DnsTarget | None:
    """The DNS target a worker source names, None for a plain URL; ValueError if it is malformed."""
    if not source.startswith(PREFIX):
        return None
    name, _, port = source[len(PREFIX):].rpartition(":")
    if not name or not port.isdecimal() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{source!r}: a DNS worker source is dns:NAME:PORT (e.g. dns:flowprefill-worker:8001)")
    return DnsTarget(name.strip("/"), int(port))


def split_sources(sources: Iterable[str]) -> tuple[list[str], list[DnsTarget]]:
    """(plain URLs, DNS targets) of a worker list."""
    urls, targets = [], []
    for source in sources:
        if (target := parse_target(source)) is None:
            urls.append(source.rstrip("/"))
        else:
            targets.append(target)
    return urls, targets


class LookupFailed(Exception):
    """No answer to rely on (the members already known stay)."""


class Resolver:
    """A and AAAA lookups with dnspython's asyncio resolver, asking the configured nameservers."""

    def __init__(self, settings: DiscoverySettings) -> None:
        import dns.asyncresolver

        self._resolver = dns.asyncresolver.Resolver(configure=False)
        self._resolver.nameservers = list(settings.nameservers)
        self._resolver.port = settings.port
        self._resolver.lifetime = settings.timeout_s

    async def addresses(self, name: str) -> set[str]:
        """Every IPv4 and IPv6 address of `name` (none when it does not exist); LookupFailed when
        the resolver could not find out."""
        if (address := _literal(name)) is not None:
            return address
        found = await asyncio.gather(self._lookup(name, "A"), self._lookup(name, "AAAA"), return_exceptions=True)
        for outcome in found:  # A's failure before AAAA's, not whichever lost the race: the same outage
            if isinstance(outcome, BaseException):  # reads the same at every lookup, so it is logged once
                raise outcome
        return found[0] | found[1]  # type: ignore[operator]

    async def _lookup(self, name: str, rdtype: str) -> set[str]:
        import dns.exception
        import dns.resolver

        try:
            answer = await self._resolver.resolve(name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return set()
        except dns.exception.DNSException as exc:
            raise LookupFailed(f"{rdtype} lookup failed: {exc}") from None
        return {rr.address for rr in answer}


# getaddrinfo's answers that mean "no such name, or no address for it": an empty source, as NXDOMAIN
# and NoAnswer are above. Any other (EAI_AGAIN: no nameserver answered; EAI_FAIL) is a failed lookup.
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class SystemResolver:
    """The system's resolver, as every other program on the machine uses it (getaddrinfo, in
    asyncio's executor): /etc/hosts, then DNS with /etc/resolv.conf's servers, search domains and
    ndots (a Kubernetes pod's short Service names), per /etc/nsswitch.conf."""

    def __init__(self, settings: DiscoverySettings) -> None:
        self.timeout_s = settings.timeout_s

    async def addresses(self, name: str) -> set[str]:
        """Every IPv4 and IPv6 address of `name` (none when it does not exist); LookupFailed when
        the resolver could not find out."""
        if (address := _literal(name)) is not None:
            return address
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(name, None, type=socket.SOCK_STREAM), self.timeout_s)
        except socket.gaierror as exc:
            if exc.errno in _NO_ADDRESS:
                return set()
            raise LookupFailed(f"lookup failed: {exc.strerror}") from None
        except TimeoutError:
            raise LookupFailed(f"lookup failed: no answer within {self.timeout_s:g} s") from None
        return {str(ipaddress.ip_address(sockaddr[0])) for family, *_, sockaddr in infos
                if family in (socket.AF_INET, socket.AF_INET6)}


def _literal(name: str) -> set[str] | None:
    """{name} when it is an address already (nothing to look up), else None."""
    try:
        return {str(ipaddress.ip_address(name))}
    except ValueError:
        return None


def resolver(settings: DiscoverySettings) -> Resolver | SystemResolver:
    """The configured nameservers' (dnspython), or, with none configured, the system's."""
    return Resolver(settings) if settings.nameservers else SystemResolver(settings)


class Discovery:
    """The worker URLs a pool's sources stand for now: its plain URLs, and each DNS target's
    addresses at its last successful lookup."""

    def __init__(self, urls: list[str], targets: list[DnsTarget], settings: DiscoverySettings) -> None:
        self.urls, self.targets, self.interval_s = urls, targets, settings.interval_s
        self.resolver = resolver(settings)
        self.resolved = False  # a first round of lookups has run
        self._known: dict[DnsTarget, set[str]] = {t: set() for t in targets}
        self._problem: dict[DnsTarget, str | None] = dict.fromkeys(targets)

    async def members(self) -> dict[str, str]:
        """Look every target up again: {worker URL: the source it comes from}."""
        await asyncio.gather(*(self._refresh(t) for t in self.targets))
        self.resolved = True
        found = {url: "listed" for url in self.urls}
        for target, addresses in self._known.items():
            found.update({target.url(a): str(target) for a in sorted(addresses)})
        return found

    async def _refresh(self, target: DnsTarget) -> None:
        try:
            addresses = await self.resolver.addresses(target.name)
        except LookupFailed as exc:
            problem = str(exc)
            if problem != self._problem[target]:
                log.warning("%s: %s; keeping its %d known worker(s)", target, problem, len(self._known[target]))
            self._problem[target] = problem
            return
        problem = None if addresses else "no A or AAAA records"
        if problem != self._problem[target]:
            if problem:
                log.warning("%s: %s (no worker there)", target, problem)
            elif self._problem[target]:
                log.info("%s resolves again (%d addresses)", target, len(addresses))
        self._problem[target] = problem
        self._known[target] = addresses
