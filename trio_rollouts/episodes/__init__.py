"""episodes"""
