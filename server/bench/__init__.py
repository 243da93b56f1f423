"""`kvserve bench`: a load generator for any OpenAI-compatible server, with a summary, JSON and an HTML report.

Only httpx and the standard library (plus `tokenizers` for exact prompt lengths) are imported here, never the
engine or torch, so the bench starts fast and runs from a plain install against a remote server.
"""
