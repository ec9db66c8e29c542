"""Backblaze B2 on loopback: our own B2 native-API server over b2sdk's simulator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastload._extras import import_extra
from fastload.testing._process import (
    ServerProcess,
    http_answers,
    python_module_command,
)

KEY_ID = "fastload-b2-key-id"
KEY = "fastload-b2-secret-7e11"  # a test secret: the tests grep output for it


class B2Server(ServerProcess):
    """``python -m fastload.testing._b2app`` on a free port, one account with a master key."""

    name = "b2-server"
    key_id = KEY_ID
    key = KEY

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> Sequence[str]:
        return python_module_command(
            "fastload.testing._b2app",
            "--port",
            str(self.port),
            "--key-id",
            self.key_id,
            "--key",
            self.key,
        )

    def ready(self) -> bool:
        return http_answers(f"{self.endpoint}/b2api/v3/b2_authorize_account")

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """Options for fastload's ``b2://`` filesystem (realm = this server or a proxy)."""
        return {"key_id": self.key_id, "key": self.key, "realm": endpoint or self.endpoint}

    def api(self, endpoint: str | None = None) -> Any:
        """An authorized ``b2sdk.v2.B2Api`` talking to this server over HTTP."""
        b2 = import_extra("b2sdk.v2", extra="b2", feature="the B2 test server")
        api = b2.B2Api(b2.InMemoryAccountInfo())
        api.authorize_account(endpoint or self.endpoint, self.key_id, self.key)
        return api

    def create_bucket(self, name: str) -> None:
        api = self.api()
        if name not in {bucket.name for bucket in api.list_buckets()}:
            api.create_bucket(name, "allPrivate")
