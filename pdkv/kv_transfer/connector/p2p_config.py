"""Typed settings of the P2PConnector (`kv_connector_extra_config`), parsed once, defaults here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

_INTS = ("kv_port", "transfer_port", "kv_pulls_per_peer", "kv_pull_threads",
         "kv_server_max_connections")
_FLOATS = ("kv_lease_duration", "transfer_timeout", "kv_server_idle_timeout")
_STRS = ("transfer", "kv_host", "kv_advertise_host", "mooncake_protocol", "transfer_mode")
TRANSFER_MODES = ("pull", "push")
PUSH_TRANSFERS = ("tcp", "shm", "mooncake")
"""Transfer engines that write (push mode): tcp two-sided, shm and mooncake one-sided with a
reservation first (pdkv/kv_transfer/engine/push_control.py)."""


@dataclass(frozen=True)
class P2PConfig:
    """P2PConnector settings (every key optional; an unknown key is refused).

    Attributes:
        transfer: transfer engine name (tcp | shm | mooncake).
        kv_host: bind host of the producer's control server.
        kv_port: its port (0: any free port); rank r of a multi-rank engine listens on
            kv_port + r.
        kv_advertise_host: the host put into kv_transfer_params ("": kv_host; never a wildcard).
        transfer_port: tcp data port (0: any free port); rank r uses transfer_port + r.
        kv_lease_duration: seconds a producer holds a request's blocks unless renewed.
        transfer_timeout: seconds one pull may take, from submit.
        kv_pulls_per_peer: concurrent pulls per producer.
        kv_pull_threads: threads pulling (all producers together).
        kv_server_max_connections: connections the control / tcp data servers accept at once.
        kv_server_idle_timeout: seconds an idle server connection is kept.
        mooncake_protocol: the mooncake transfer engine's protocol.
        transfer_mode: "pull" (D reads P's held blocks after P's prefill; the default) or
            "push" (P writes each layer's KV into blocks D granted, while it computes the next
            layers; vLLM's NIXL connector push mode, vLLM-Ascend's layer-wise connector;
            pdkv/kv_transfer/connector/p2p_push.py).
    """

    transfer: str = "tcp"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_advertise_host: str = ""
    transfer_port: int = 0
    kv_lease_duration: float = 30.0
    transfer_timeout: float = 30.0
    kv_pulls_per_peer: int = 2
    kv_pull_threads: int = 16
    kv_server_max_connections: int = 64
    kv_server_idle_timeout: float = 60.0
    mooncake_protocol: str = "tcp"
    transfer_mode: str = "pull"

    @staticmethod
    def from_extra(extra: Mapping[str, object]) -> P2PConfig:
        """Parse and check `kv_connector_extra_config` (a null value means the default).

        Raises:
            ValueError: an unknown key (a typo would otherwise be ignored), a setting of the
                wrong type or a negative number (the message names the key and the value).
        """
        known = (*_INTS, *_FLOATS, *_STRS)
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"unknown P2PConnector settings {unknown}; known: {sorted(known)}")
        ints: dict[str, int] = {}
        floats: dict[str, float] = {}
        strs: dict[str, str] = {}
        for key in _INTS:
            value = extra.get(key)
            if value is None:
                continue
            if (isinstance(value, bool) or not isinstance(value, int | float) or value < 0
                    or value != int(value)):
                raise ValueError(f"P2PConnector {key} must be an integer >= 0, got {value!r}")
            ints[key] = int(value)
        for key in _FLOATS:
            value = extra.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"P2PConnector {key} must be a number >= 0, got {value!r}")
            floats[key] = float(value)
        for key in _STRS:
            value = extra.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"P2PConnector {key} must be a string, got {value!r}")
            strs[key] = value
        mode = strs.get("transfer_mode", "pull")
        if mode not in TRANSFER_MODES:
            raise ValueError(
                f"P2PConnector transfer_mode must be one of {list(TRANSFER_MODES)}, got {mode!r}"
            )
        d = P2PConfig()  # the defaults
        if mode == "push" and strs.get("transfer", d.transfer) not in PUSH_TRANSFERS:
            raise ValueError(
                f"P2PConnector transfer_mode 'push' writes over the {', '.join(PUSH_TRANSFERS)} "
                f"transfer engines only (transfer {strs.get('transfer')!r}): use one of them or "
                "transfer_mode 'pull'"
            )
        return P2PConfig(
            transfer=strs.get("transfer", d.transfer),
            kv_host=strs.get("kv_host", d.kv_host),
            kv_port=ints.get("kv_port", d.kv_port),
            kv_advertise_host=strs.get("kv_advertise_host", d.kv_advertise_host),
            transfer_port=ints.get("transfer_port", d.transfer_port),
            kv_lease_duration=floats.get("kv_lease_duration", d.kv_lease_duration),
            transfer_timeout=floats.get("transfer_timeout", d.transfer_timeout),
            kv_pulls_per_peer=ints.get("kv_pulls_per_peer", d.kv_pulls_per_peer),
            kv_pull_threads=ints.get("kv_pull_threads", d.kv_pull_threads),
            kv_server_max_connections=ints.get("kv_server_max_connections",
                                               d.kv_server_max_connections),
            kv_server_idle_timeout=floats.get("kv_server_idle_timeout", d.kv_server_idle_timeout),
            mooncake_protocol=strs.get("mooncake_protocol", d.mooncake_protocol),
            transfer_mode=mode,
        )
