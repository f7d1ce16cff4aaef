"""liveness"""
