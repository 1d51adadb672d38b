"""The server: the Starlette app, the device worker, the websocket protocol and limits, the OpenAI API."""
