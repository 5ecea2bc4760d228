/* One thread's packed matrix product, timed: tensor_rows over a random
   packed matrix (a measurement, not a test). Thread CPU time, best of 7,
   so that other work on a shared machine lowers it less; GOP/s against
   the set's --probe int8 peak and
   a 16-chain vpdpbusd peak (two a cycle on both vector ports), both
   measured in the same process (the latter only where the CPU has AVX-512
   VNNI). The set: the best this CPU runs, or SET.
   Build: cc -O3 -march=native -I. tests/bench_kernels.c tokenizer.c -lm -o bench_kernels
   Run:   ./bench_kernels TYPE ROWS COLS TOKENS [SET], e.g. q4_k 8960 1536 72
   Or:    ./bench_kernels ports: vpdpbusd's rate in 16 chains alone and
          beside four of another instruction per 16 (independent chains,
          registers only; a 64-byte store to a line of a 4 KB ring): the
          instructions that slow it share its ports, and each K-type
          product's count of them per 64 vpdpbusd bounds its rate. */
#define main run_main
#include "../run.c"
#undef main
#include <immintrin.h>
static double cpu_now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static uint64_t rng = 88172645463325252ull;
static void fill(uint8_t *g, int type, int rows, int cols){
  const PackForm *f=&TYPES[type].pack; size_t gb=packed_group_bytes(f,cols), rb=packed_record_bytes(f);
  for(size_t b=0;b<gb*(rows/PACK_ROWS);b++) g[b]=random_u32(&rng);
  int halves = f->kind==PACK_K6?1:1+(f->kind==PACK_K4||f->has_min);
  for(int grp=0;grp<rows/PACK_ROWS;grp++) for(int k=0;k<cols/packed_block(f);k++){
    uint8_t *rec=g+grp*gb+k*rb; 
    for(int p=0;p<halves;p++) for(int r=0;r<PACK_ROWS;r++){ uint16_t h=0x2000+(random_u32(&rng)&0x3ff); memcpy(rec+2*(p*PACK_ROWS+r),&h,2);} }
}
/* 16 vpdpbusd chains and, per 16, the instruction X four times on four chains of its own. */
#define VNNI16 ASM1(a0) ASM1(a1) ASM1(a2) ASM1(a3) ASM1(a4) ASM1(a5) ASM1(a6) ASM1(a7) \
               ASM1(a8) ASM1(a9) ASM1(a10) ASM1(a11) ASM1(a12) ASM1(a13) ASM1(a14) ASM1(a15)
#define ASM1(r) __asm__ volatile("vpdpbusd %2, %1, %0" : "+v"(r) : "v"(x), "v"(y));
#define PORT_LOOP(name, X) __attribute__((target("avx512f,avx512bw,avx512vnni"))) static double port_##name(void){ \
  __m512i a0=_mm512_set1_epi32(1),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0,a12=a0,a13=a0,a14=a0,a15=a0; \
  __m512i x=_mm512_set1_epi8(3), y=_mm512_set1_epi8(-2), e0=a0, e1=a0, e2=a0, e3=a0; __m512 f0=_mm512_set1_ps(1), f1=f0, f2=f0, f3=f0; \
  static char ring[4096] __attribute__((aligned(64))); unsigned at=0; long n=4000000; double t=cpu_now(); \
  for(long i=0;i<n;i++){ VNNI16 X } \
  double e=cpu_now()-t; unsigned s=(unsigned)_mm_cvtsi128_si32(_mm512_castsi512_si128(_mm512_add_epi32(a0,_mm512_add_epi32(e0,e3)))); \
  if(s==1&&_mm512_reduce_add_ps(_mm512_add_ps(f0,f3))==0){ puts(""); } (void)e1; (void)e2; (void)f1; (void)f2; (void)at; (void)ring; \
  return n*16/e/1e9; }
#define X4(ins, r) __asm__ volatile(ins : "+v"(r##0) : "v"(x)); __asm__ volatile(ins : "+v"(r##1) : "v"(x)); \
                   __asm__ volatile(ins : "+v"(r##2) : "v"(x)); __asm__ volatile(ins : "+v"(r##3) : "v"(x));
#define F4(ins) __asm__ volatile(ins : "+v"(f0) : "v"(f1)); __asm__ volatile(ins : "+v"(f1) : "v"(f2)); \
                __asm__ volatile(ins : "+v"(f2) : "v"(f3)); __asm__ volatile(ins : "+v"(f3) : "v"(f0));
#define ST1(k) __asm__ volatile("vmovdqu64 %1, %0" : "=m"(*(__m512i *)(ring + ((at + 64 * k) & 4095))) : "v"(e0));
PORT_LOOP(alone, )
PORT_LOOP(vpmulld, X4("vpmulld %1, %0, %0", e))
PORT_LOOP(vpdpwssd, X4("vpdpwssd %1, %1, %0", e))
PORT_LOOP(vpmaddwd, X4("vpmaddwd %1, %0, %0", e))
PORT_LOOP(vfmadd, F4("vfmadd231ps %1, %1, %0"))
PORT_LOOP(vmulps, F4("vmulps %1, %0, %0"))
PORT_LOOP(vpaddd, X4("vpaddd %1, %0, %0", e))
PORT_LOOP(vpternlogd, X4("vpternlogd $0xf8, %1, %1, %0", e))
PORT_LOOP(store, ST1(0) ST1(1) ST1(2) ST1(3) at += 256;)
/* A K tile's mix on those ports per 64 vpdpbusd (a super-block and token of q4k_tokens_512, q6k_tokens_512):
   q4_k 8 vpmulld, 4 vpdpwssd, 2 vmulps, 2 vfmadd; q6_k 16, 8, 1, 1. Loads, stores and unpacking left out. */
#define MIX(mull, wssd, fl) VNNI16 VNNI16 VNNI16 for(int m=0;m<mull/4;m++){X4("vpmulld %1, %0, %0", e)} \
  for(int w=0;w<wssd/4;w++){X4("vpdpwssd %1, %1, %0", e)} __asm__ volatile("vmulps %1, %0, %0" : "+v"(f0) : "v"(f1)); \
  __asm__ volatile("vfmadd231ps %1, %1, %0" : "+v"(f2) : "v"(f3)); if(fl>1){__asm__ volatile("vmulps %1, %0, %0" : "+v"(f1) : "v"(f0)); \
  __asm__ volatile("vfmadd231ps %1, %1, %0" : "+v"(f3) : "v"(f2));}
PORT_LOOP(mix_q4_k, MIX(8, 4, 2))
PORT_LOOP(mix_q6_k, MIX(16, 8, 1))
static int ports(void){
  if(!__builtin_cpu_supports("avx512vnni")){ fprintf(stderr, "bench_kernels: ports needs AVX-512 VNNI\n"); return 1; }
  struct { const char *name; double (*fn)(void); } p[] = {{"alone", port_alone}, {"vpmulld", port_vpmulld}, {"vpdpwssd", port_vpdpwssd},
    {"vpmaddwd", port_vpmaddwd}, {"vfmadd231ps", port_vfmadd}, {"vmulps", port_vmulps}, {"vpaddd", port_vpaddd},
    {"vpternlogd", port_vpternlogd}, {"64-byte store", port_store}};
  struct { const char *name; double (*fn)(void); } mix[] = {{"q4_k", port_mix_q4_k}, {"q6_k", port_mix_q6_k}};
  int n = sizeof p / sizeof *p; double best[16] = {0};
  for(int r=0;r<5;r++) for(int i=0;i<n;i++){ double g=p[i].fn(); if(g>best[i]) best[i]=g; } /* best of 5: the least disturbed */
  printf("vpdpbusd in 16 chains, G/s (best of 5), beside 4 of X per 16; X's cost in vpdpbusd slots = 16/4 * (alone/with - 1)\n");
  for(int i=0;i<n;i++) printf("  %-14s %6.2f G/s  %5.2f slots\n", p[i].name, best[i], i ? 4.0*(best[0]/best[i]-1) : 0.0);
  printf("a K tile's instructions on those ports per super-block and token (its bound; the rest of the tile left out):\n");
  for(int i=0;i<2;i++){ double b=0; for(int r=0;r<5;r++){ double g=4*mix[i].fn(); if(g>b) b=g; }
    printf("  %-5s %6.2f G vpdpbusd/s  %5.1f%% of alone\n", mix[i].name, b, 100*b/best[0]); }
  return 0;
}

int main(int argc, char **argv){
  if(argc>1 && !strcmp(argv[1],"ports")) return ports();
  int set = best_kernel_set();
  const char *tname = argc>1?argv[1]:"q4_k"; int rows = argc>2?atoi(argv[2]):8960, cols=argc>3?atoi(argv[3]):1536, ntok=argc>4?atoi(argv[4]):72;
  if(argc>5) for(int s=0;s<N_KSETS;s++) if(SETS[s]&&!strcmp(SETS[s]->op.name,argv[5])) set=s;
  select_kernels(set);
  int type=-1; for(int t=0;t<N_TYPES;t++) if(TYPES[t].name&&!strcmp(TYPES[t].name,tname)) type=t;
  const PackForm *f=&TYPES[type].pack; int act=TYPES[type].act;
  size_t gb=packed_group_bytes(f,cols); uint8_t *w=aligned_alloc(64, gb*(rows/PACK_ROWS)); fill(w,type,rows,cols);
  size_t xs=act_bytes(act,cols); uint8_t *xq=malloc(xs*ntok); float *xf=malloc(sizeof(float)*cols);
  for(int t=0;t<ntok;t++){ for(int i=0;i<cols;i++) xf[i]=random_f32(&rng)*2-1; if(act!=ACT_F32) quantize_act(act,xq+t*xs,xf,cols); else memcpy(xq+t*xs,xf,xs);}
  float *out=malloc(sizeof(float)*rows*ntok);
  Tensor T={"w",type,rows,cols,LAYOUT_PACKED,w};
  double best=1e9; unsigned sink=0;
  double pk=__builtin_cpu_supports("avx512vnni")?port_alone()*128e9:0; /* 64 products, 128 ops a vpdpbusd */ double t0=cpu_now(); double probe=K.op.peak_i8(&sink)/(cpu_now()-t0);
  int reps = (int)(2e9/(2.0*rows*cols*ntok))+1; if(reps>200)reps=200;
  for(int it=0;it<7;it++){ double t=cpu_now(); for(int r=0;r<reps;r++) tensor_rows((Out){out,rows,0},&T,(Act){xq,xs},ntok,0,rows); double e=(cpu_now()-t)/reps; if(e<best)best=e; }
  double gops=2.0*rows*cols*ntok/best;
  char vnni[64] = "";
  if (pk > 0) snprintf(vnni, sizeof vnni, "  %5.1f%% of 16-chain peak (%.0f)", 100*gops/pk, pk/1e9);
  printf("%-5s %-7s %5dx%-5d tok %3d: %7.3f ms  %6.1f GOP/s  %5.1f%% of probe peak (%.0f)%s  checksum %.4g\n",
     SETS[set]->op.name, tname, rows, cols, ntok, best*1e3, gops/1e9, 100*gops/probe, probe/1e9, vnni, out[0]+out[rows*ntok-1]);
  return 0;
}
