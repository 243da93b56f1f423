"""What one benchmark run sends and where: the target, the request fields and the pacing, after the flags."""

from dataclasses import asdict, dataclass

from kvserve.server.bench.endpoints import ENDPOINT_PATHS, Endpoint


@dataclass(frozen=True)
class BenchConfig:
    base_url: str  # without /v1: /metrics sits at the root
    model: str
    endpoint: Endpoint
    api_key: str | None
    ignore_eos: bool
    temperature: float
    request_rate: float  # requests per second, Poisson arrivals; inf sends them all at once
    max_concurrency: int | None  # at most this many in flight; None: no limit
    timeout_s: float  # per request, from sending it to the end of its stream
    seed: int

    @property
    def request_url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        headers = auth_headers(self.api_key)
        if self.api_key and self.endpoint == "messages":
            headers["x-api-key"] = self.api_key  # Anthropic's header, which servers of its API may want instead
        return headers

    def public_dict(self) -> dict:
        """The settings for result files: everything but the API key, which must not land on disk."""
        return {name: value for name, value in asdict(self).items() if name != "api_key"}


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
