"""OpenAI's Responses API (/v1/responses): the request read into a chat request
(translate.py), the response object and its stream of events (events.py), the
responses kept for retrieval, resume and cancel (store.py), the generation that
fills one (runner.py) and the HTTP routes (api.py)."""
