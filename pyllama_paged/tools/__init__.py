"""Tool calling: tools rendered into the prompt through the chat template,
tool calls parsed out of the answer (streaming too), and forced calls held to
a grammar."""
