import torch, torch.nn as nn, lora_ops
class M(nn.Module):
    def __init__(s): super().__init__(); s.q=nn.Linear(8,8)
    def forward(s,x): return s.q(x)
m=M(); ctx=lora_ops.apply_lora(m,["q"],max_loras=2,max_rank=4,max_tokens=64)
ctx.load_adapter_tensors("a",{"q.lora_A.weight":torch.randn(4,8),"q.lora_B.weight":torch.randn(8,4)}) if hasattr(ctx,"load_adapter_tensors") else lora_ops.load_adapter_tensors(ctx,"a",{"q.lora_A.weight":torch.randn(4,8),"q.lora_B.weight":torch.randn(8,4)})
base=torch.randn(1,5,8)
with torch.no_grad(), ctx.per_row(["a","a","a"]):
    for name,x in [("contig",base.repeat(3,1,1)),("expanded",base.expand(3,5,8)),("bf-from-seqfirst",base.repeat(3,1,1).transpose(0,1).contiguous().transpose(0,1))]:
        try: y=m(x); print(name,"ok")
        except Exception as e: print(name,"FAIL",str(e)[:120])
