"""hivemind 1.1.12's per-request authentication, timed (run by bench/auth.py in the hivemind venv).

A token authorizer as hivemind's tests write one (an authority's RSA-2048 key signs each peer's
token, the peer's RSA-2048 key signs each request and response), around a DHT ping request:
sign_request, validate_request, sign_response, validate_response. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from datetime import datetime, timedelta
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("requests", type=int, nargs="?", default=300)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.requests))))


def _classes() -> tuple[Any, Any]:
    """hivemind's classes, imported here: ``--help`` (bench smoke test) runs without hivemind."""
    from hivemind.proto.auth_pb2 import AccessToken
    from hivemind.utils.auth import TokenAuthorizerBase
    from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

    class Authority:
        def __init__(self) -> None:
            self.key = RSAPrivateKey()

        def token(self, username: str, public_key: RSAPublicKey) -> AccessToken:
            token = AccessToken(username=username, public_key=public_key.to_bytes(),
                                expiration_time=str(datetime.utcnow() + timedelta(minutes=15)))
            token.signature = self.key.sign(self.payload(token))
            return token

        @staticmethod
        def payload(token: AccessToken) -> bytes:
            return f"{token.username} {token.public_key} {token.expiration_time}".encode()

    class Authorizer(TokenAuthorizerBase):  # type: ignore[misc]
        def __init__(self, authority: Authority, username: str) -> None:
            super().__init__(RSAPrivateKey())
            self._authority = authority
            self._username = username

        async def get_token(self) -> AccessToken:
            return self._authority.token(self._username, self.local_public_key)

        def is_token_valid(self, access_token: AccessToken) -> bool:
            data = Authority.payload(access_token)
            return bool(self._authority.key.get_public_key().verify(data, access_token.signature)) and \
                datetime.fromisoformat(access_token.expiration_time) > datetime.utcnow()

        def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
            return False

    return Authority, Authorizer


async def measure(requests: int) -> dict[str, float]:
    from hivemind.proto import dht_pb2

    Authority, Authorizer = _classes()
    authority = Authority()
    client, server = Authorizer(authority, "alice"), Authorizer(authority, "bob")
    await client.refresh_token_if_needed()
    await server.refresh_token_if_needed()
    per_request = []
    for _ in range(requests):
        started = time.perf_counter()
        request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(), validate=True)
        await client.sign_request(request, server.local_public_key)
        assert await server.validate_request(request)
        response = dht_pb2.PingResponse(peer=dht_pb2.NodeInfo(), dht_time=time.time())
        await server.sign_response(response, request)
        assert await client.validate_response(response, request)
        per_request.append(time.perf_counter() - started)
    return {"requests": requests, "min_ms": min(per_request) * 1e3, "median_ms": statistics.median(per_request) * 1e3}


if __name__ == "__main__":
    main()
