"""Integrations with libraries that drive PyTorch models (serving engines, trainers).

Each lives in its own module or package and imports its library only when used, so importing
torchtpu never pulls them in.
"""
