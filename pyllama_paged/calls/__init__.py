"""The request core every API surface shares: a call to the model whichever API it came by
(chat and prompt calls, their sampling options, token events as text), and embedding and
rerank inputs and results."""
