"""AgentBoard's evaluation protocol, implemented from its fact sheet, on the user's AgentBoard checkout.

See docs/eval.md ("AgentBoard protocol"). Nothing here contains AgentBoard code or data: prompts, episode
lists and game files are read from the checkout at run time (`checkout.Checkout`).
"""
