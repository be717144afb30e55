"""API keys. A request carries `Authorization: Bearer <key>` (HTTP header or gRPC metadata); HTTP
also accepts `X-API-Key: <key>`. Keys are compared with hmac.compare_digest, against every
configured key (no early exit), so the time taken says nothing about how much of a key matched.
Health routes are exempt so that load balancers and orchestrators need no secret.
"""

from __future__ import annotations

import hmac


class APIKeyChecker:
    def __init__(self, keys: tuple[str, ...] | list[str]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check_key(self, key: str | None) -> bool:
        if not self._keys:
            return True
        if not key:
            return False
        given = key.encode()
        ok = False
        for k in self._keys:
            ok |= hmac.compare_digest(given, k)
        return ok

    def check_authorization(self, authorization: str | None, x_api_key: str | None = None) -> bool:
        """True when either header carries a valid key (or no keys are configured)."""
        if not self._keys:
            return True
        bearer = None
        if authorization:
            scheme, _, value = authorization.strip().partition(" ")
            if scheme.lower() == "bearer":
                bearer = value.strip()
        # Check both without short-circuiting on the first; either may be absent.
        a = self.check_key(bearer)
        b = self.check_key(x_api_key)
        return a or b
