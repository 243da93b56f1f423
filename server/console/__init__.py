"""The web console: static pages (no build step) served at /console/, fed by the /v1 routes.

`static/` holds plain HTML, CSS and JavaScript modules; nothing is fetched from elsewhere at run time.
"""

from pathlib import Path

from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC_DIR = Path(__file__).parent / "static"

# The pages run only their own files and talk only to this server; nothing may frame them.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated each load, so a server upgrade never serves stale scripts
}


class ConsoleFiles(StaticFiles):
    """The console's files, `index.html` for the directory, each answered with SECURITY_HEADERS."""

    def __init__(self) -> None:
        super().__init__(directory=STATIC_DIR, html=True)

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response
