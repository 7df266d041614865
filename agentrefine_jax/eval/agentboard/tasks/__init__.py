"""One module per AgentBoard task; `base` is the contract the protocol loop drives."""
