"""multiattn"""
