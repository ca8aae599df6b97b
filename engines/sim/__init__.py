"""`--simulate HARDWARE`: the engines' real control code on a virtual clock.

Weights and KV live on torch's meta device (shapes, no data); a routing source picks each
token's experts; the simulated executor drives the expert backend's control path and a cost
model (calibrated per hardware profile) gives each step's duration, by which the run's clock
moves. Why and how it is validated: docs/simulation.md.
"""
